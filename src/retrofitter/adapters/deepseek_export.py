"""A model converted to MLA (modules/mla_attention.py) as an ordinary DeepSeek-V3 checkpoint.

``DeepseekV3ForCausalLM`` with every layer dense (``first_k_dense_replace`` = n_layers), a plain query
projection (``q_lora_rank`` null) and ``num_key_value_heads`` = ``num_attention_heads``. Per layer and head i
(h heads, latent r, query no-rotation part r', rotary key 2m, head dim dh):

    q_proj             [h·(r' + 2m), d]   per head [q_nope, q_pe], q_pe in DeepSeek's interleaved pairs
    kv_a_proj_with_mqa [r + 2m, d]        [α·A ; W_pe]       (c' = α c, k_pe as ours, interleaved)
    kv_a_layernorm     [r]                w = √ε / α         (see below)
    kv_b_proj          [h·(r' + dh), r]   per head [K_up ; V_up,group(i)], the identity where folded into q / o
    o_proj             [d, h·dh]

Every step is an exact rewrite, up to float rounding, of what retrofitter's module computes:

* **RoPE.** Our slot j rotates dims (j, m + j) (rotate-half) at the model's θ_{f_j}. DeepSeek rotates pairs
  (2j, 2j + 1) at θ'_j = base'^(−j/m). Rows are permuted to that layout, slots sorted by frequency; the
  frequencies must be f_j = j·s (``rope_selection="progression"``), then one base' reproduces them (exactly
  in real arithmetic; fitted to every slot, log θ_{f_j} = −(j/m)·log base', it matches the float32 table to
  its rounding). Anything else is refused (one line).
* **The latent's RMSNorm.** DeepSeek always normalises the latent: w ⊙ c' / √(mean(c'²) + ε). With c' = α c,
  w = √ε / α this is c / √(1 + δ), δ = α² mean(c²) / ε. The norm's input is x = w_ln ⊙ u with |u|² ≤ d (the
  decoder's input RMSNorm), so mean(c²) ≤ σ_max(A·diag(w_ln))² · d / r for *every* input: α is the power
  of two that keeps δ ≤ 2⁻³⁰ (``LATENT_NORM_SLACK``), below float32 rounding. The cache then holds c itself.
* **ε.** HF builds ``kv_a_layernorm`` with ε = 1e-6 whatever the config says, llama.cpp uses the config's
  ``rms_norm_eps``: the export writes ε' = 1e-6 everywhere and scales the residual stream by β = √(ε'/ε)
  (embedding, o_proj, down_proj × β; the final norm's weight ÷ β where the head is tied), which every
  RMSNorm(β h; ε') = RMSNorm(h; ε) turns into the original function.
* **Scale.** DeepSeek scores with (r' + 2m)^−½; our softmax scale is folded into the query rows.
* Layers with smaller r or r' than the largest are padded with zero rows / columns (exact; the cache then
  holds the largest r for every layer).

MLPs stay the dense gate/up/down projections (factored ones are refused: multiply them back first).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..modules.mla_attention import MLAAttention
from .mla_attention import model_inv_freq
from .registry import UnsupportedArchitectureError, adapter_for

__all__ = ["EXPORTABLE_ARCHITECTURES", "DEEPSEEK_EPS", "LATENT_NORM_SLACK", "check_deepseek_exportable",
           "deepseek_v3_checkpoint"]

EXPORTABLE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
DEEPSEEK_EPS = 1e-6          # HF's DeepseekV3RMSNorm default, which kv_a_layernorm is built with
LATENT_NORM_SLACK = 2.0 ** -30  # bound on δ = α² mean(c²) / ε over every possible input


class ExportError(UnsupportedArchitectureError):
    """The model's layout cannot be written in the target format; the message names what is missing."""


def _mla_layers(model: nn.Module) -> list[MLAAttention]:
    adapter = adapter_for(model)
    layers = adapter.decoder_layers(model)
    out = []
    for index, layer in enumerate(layers):
        attention = adapter.attention(layer)
        if not isinstance(attention, MLAAttention):
            raise ExportError(f"export to DeepSeek-V3 needs every attention layer in MLA form (retrofitter mla); "
                              f"layer {index} is {type(attention).__name__}")
        out.append(attention)
    return out


def _progression(attention: MLAAttention, inv_freq: torch.Tensor, index: int) -> tuple[torch.Tensor, float]:
    """(order [m]: slots by ascending frequency, base') or ExportError."""
    freq = attention.freq_index.cpu()
    order = torch.argsort(freq, stable=True)
    f = freq[order]
    m = f.numel()
    step = int(f[1]) if m > 1 else 0
    if m == 0 or int(f[0]) != 0 or any(int(f[j]) != j * step for j in range(m)) or (m > 1 and step < 1):
        raise ExportError(f"layer {index}: its rotary slots use frequency pairs {f.tolist()}, but DeepSeek's rotary "
                          f"key needs the progression 0, s, 2s, ...; convert with --rope-selection progression")
    theta = inv_freq[f].double()
    # log θ_j = −(j/m)·log base' for every slot: fitted by least squares through the origin (θ_0 = 1). Taking it
    # from θ_1 alone, base' = θ_1^(−m), multiplies θ_1's float32 rounding by m (32 slots: 2e-6, above the check)
    j = torch.arange(m, dtype=torch.float64)
    base = math.exp(float(-m * (j * theta.log()).sum() / (j * j).sum())) if m > 1 else 10000.0
    expected = base ** (-j / m)
    if not torch.allclose(theta, expected, rtol=1e-6, atol=0.0):  # float32 tables on both sides
        raise ExportError(f"layer {index}: the model's rotary frequencies (its rope scaling) are not a DeepSeek "
                          f"table base^(-j/m) of one base")
    return order, base


def check_deepseek_exportable(model: nn.Module) -> None:
    """Raise ``ExportError`` (one line naming what is missing) unless ``deepseek_v3_checkpoint`` can write
    ``model`` exactly."""
    name = type(model).__name__
    if name not in EXPORTABLE_ARCHITECTURES:
        raise ExportError(f"export to DeepSeek-V3 supports {', '.join(EXPORTABLE_ARCHITECTURES)} converted to MLA; "
                          f"got {name}")
    adapter = adapter_for(model)
    inv_freq = model_inv_freq(model)
    rotary = model.get_submodule(adapter.rotary_path)
    if float(getattr(rotary, "attention_scaling", 1.0)) != 1.0:
        raise ExportError("the model's rope scales its cos/sin tables (attention_scaling != 1), which a default "
                          "DeepSeek rope cannot express")
    bases, rope_dims = set(), set()
    for index, attention in enumerate(_mla_layers(model)):
        for proj in attention.linear_projections():
            if getattr(proj, "bias", None) is not None:
                raise ExportError(f"layer {index}: its attention projections carry biases, which DeepSeek-V3's "
                                  f"q_proj / kv_a_proj_with_mqa (llama.cpp) cannot hold")
        if attention.sliding_window:
            raise ExportError(f"layer {index}: sliding-window attention ({attention.sliding_window}) has no "
                              f"DeepSeek-V3 equivalent")
        _, base = _progression(attention, inv_freq, index)
        bases.add(round(base, 6))
        rope_dims.add(attention.rope_dim)
    if len(rope_dims) > 1 or len(bases) > 1:
        raise ExportError(f"DeepSeek-V3 has one rotary key size and one rope base for all layers; the layers use "
                          f"sizes {sorted(rope_dims)} and bases {sorted(bases)}")
    for index, layer in enumerate(adapter.decoder_layers(model)):
        mlp = adapter.mlp(layer)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            module = getattr(mlp, proj, None)
            if type(module) is not nn.Linear or module.bias is not None:
                raise ExportError(f"layer {index}: mlp.{proj} is {type(module).__name__}, not a plain bias-free "
                                  f"nn.Linear (a factored MLP: export a model converted by `retrofitter mla` alone)")


def _interleave(rows: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """Rows [2m, ...] in our layout (a-dims, then b-dims; slot j = (j, m + j)) → DeepSeek's pairs
    (2k, 2k + 1) = slot order[k]."""
    m = rows.shape[0] // 2
    index = torch.stack([order, order + m], 1).reshape(-1)
    return rows[index]


def _latent_scale(attention: MLAAttention, input_norm_weight: torch.Tensor, eps: float) -> float:
    """α (a power of two) keeping δ = α² mean(c²) / ε ≤ LATENT_NORM_SLACK for every input (module docstring)."""
    A = attention.kv_a_proj.weight.detach().to(torch.float64) * input_norm_weight.detach().to(torch.float64)
    sigma = float(torch.linalg.matrix_norm(A, ord=2))
    bound = sigma ** 2 * A.shape[1] / A.shape[0]  # max mean(c²) over |u|² ≤ d
    if bound == 0.0:
        return 1.0
    return 2.0 ** math.floor(0.5 * math.log2(LATENT_NORM_SLACK * eps / bound))


def deepseek_v3_checkpoint(model: nn.Module, dtype: torch.dtype = torch.float32
                           ) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict for ``DeepseekV3Config``, state dict in ``dtype``) of ``model`` (module docstring),
    computed in float64. Runs ``check_deepseek_exportable`` first."""
    check_deepseek_exportable(model)
    adapter = adapter_for(model)
    config = adapter.text_config(model)
    layers = adapter.decoder_layers(model)
    attentions = _mla_layers(model)
    inv_freq = model_inv_freq(model)
    heads, head_dim = attentions[0].n_heads, attentions[0].head_dim
    kv_rank = max(a.kv_rank for a in attentions)
    nope = max(a.qk_nope_dim for a in attentions)
    rope = attentions[0].rope_dim
    eps = float(config.rms_norm_eps)
    beta = math.sqrt(DEEPSEEK_EPS / eps)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    f64 = dict(dtype=torch.float64)
    state: dict[str, torch.Tensor] = {}

    def put(name, tensor):
        state[name] = tensor.detach().to(dtype).contiguous()

    put("model.embed_tokens.weight", adapter.input_embedding(model).weight.to(**f64) * beta)
    final_norm = model.get_submodule("model.norm").weight.to(**f64)
    put("model.norm.weight", final_norm / beta if tied else final_norm)
    if not tied:
        put("lm_head.weight", model.get_output_embeddings().weight)
    base = None
    for i, (layer, att) in enumerate(zip(layers, attentions)):
        order, base = _progression(att, inv_freq, i)
        p = f"model.layers.{i}."
        put(p + "input_layernorm.weight", layer.input_layernorm.weight)
        put(p + "post_attention_layernorm.weight", layer.post_attention_layernorm.weight)
        mlp = adapter.mlp(layer)
        put(p + "mlp.gate_proj.weight", mlp.gate_proj.weight)
        put(p + "mlp.up_proj.weight", mlp.up_proj.weight)
        put(p + "mlp.down_proj.weight", mlp.down_proj.weight.to(**f64) * beta)
        r, r1, m2 = att.kv_rank, att.qk_nope_dim, att.rope_dim
        q = att.q_proj.weight.to(**f64).view(heads, r1 + m2, -1)
        q_scale = att.scaling * math.sqrt(nope + rope)  # ours / DeepSeek's softmax scale
        q_heads = torch.zeros(heads, nope + rope, q.shape[-1], **f64)
        q_heads[:, :r1] = q[:, :r1]
        q_heads[:, nope:] = torch.stack([_interleave(q[h, r1:], order) for h in range(heads)])
        put(p + "self_attn.q_proj.weight", q_heads.reshape(-1, q.shape[-1]) * q_scale)
        alpha = _latent_scale(att, layer.input_layernorm.weight, DEEPSEEK_EPS)
        kv_a = torch.zeros(kv_rank + rope, q.shape[-1], **f64)
        kv_a[:r] = att.kv_a_proj.weight.to(**f64) * alpha
        kv_a[kv_rank:] = _interleave(att.k_pe_proj.weight.to(**f64), order)
        put(p + "self_attn.kv_a_proj_with_mqa.weight", kv_a)
        # w = √ε/α on the real dims; the padded dims are zero either way (their c' is 0)
        put(p + "self_attn.kv_a_layernorm.weight", torch.full((kv_rank,), math.sqrt(DEEPSEEK_EPS) / alpha, **f64))
        # an up-projection folded into q_proj / o_proj (MLAAttention.fold_up_projections) is the identity here
        kv_b = torch.zeros(heads, nope + head_dim, kv_rank, **f64)
        kv_b[:, :r1, :r] = torch.eye(r, **f64) if att.k_up is None else att.k_up.to(**f64)
        kv_b[:, nope:, :r] = (torch.eye(r, **f64) if att.v_up is None else att.v_up.to(**f64).view(
            att.n_kv_heads, head_dim, r).repeat_interleave(heads // att.n_kv_heads, 0))
        put(p + "self_attn.kv_b_proj.weight", kv_b.reshape(-1, kv_rank))
        put(p + "self_attn.o_proj.weight", att.o_proj.weight.to(**f64) * beta)
    n_layers = len(layers)
    hf_config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "moe_intermediate_size": config.intermediate_size,
        "num_hidden_layers": n_layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        # every layer dense, so no expert is ever built; the counts must still be ints (transformers) with
        # n_group < n_routed_experts and num_experts_per_tok <= n_routed_experts (llama.cpp's loader asserts)
        "n_shared_experts": 0, "n_routed_experts": 2, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": False, "first_k_dense_replace": n_layers,
        "kv_lora_rank": kv_rank, "q_lora_rank": None, "qk_rope_head_dim": rope, "qk_nope_head_dim": nope,
        "v_head_dim": head_dim, "head_dim": rope, "hidden_act": config.hidden_act,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": DEEPSEEK_EPS,
        "rope_interleave": True, "rope_parameters": {"rope_type": "default", "rope_theta": base},
        "attention_bias": False, "attention_dropout": 0.0, "tie_word_embeddings": tied,
        "bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
        "pad_token_id": getattr(config, "pad_token_id", None), "initializer_range": config.initializer_range,
        "dtype": str(dtype).removeprefix("torch."),
    }
    return hf_config, state
