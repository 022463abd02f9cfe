"""Attention transfer of the MLA conversion (pipelines/mla_transfer.py) on tiny models: it lowers each layer's
output error against its targets (the default residual ones, the teacher ones: the original model's attention on its
own stream, recomputed here), never leaves a layer worse (an exact full-budget layer stays exact), touches only the
MLA modules, resumes bit for bit, and epochs 0 is the training-free conversion; at skipped positions (PoSE) the
targets are the original model's attention at those positions."""

from __future__ import annotations

import functools
import weakref

import pytest
import torch

from retrofitter.adapters.mla_attention import attention_kwargs_at, attention_probabilities
from retrofitter.adapters.registry import adapter_for
from retrofitter.data.blocks import with_repeated_spans
from retrofitter.modules.mla_attention import MLAAttention
from retrofitter.pipelines import mla as mla_pipeline
from retrofitter.pipelines.calibration import LayerStream, capture_stream
from retrofitter.pipelines.mla import MLAConfig, convert_to_mla
from retrofitter.pipelines.mla_transfer import (AttentionBatch, at_positions, attention_batches, attention_kl,
                                               iter_attention_batches, kl_query_rows, mean_attention_kl, reference_weights_at_rows,
                                               relative_output_error, skipped_position_ids, teacher_targets,
                                               transfer_attention)
from tiny_models import TINY_VOCAB, strong_tiny

CALIBRATION = torch.randint(3, TINY_VOCAB, (6, 32), generator=torch.Generator().manual_seed(1))


def _convert(family, epochs, kv_ratio=0.25, **settings):
    model = strong_tiny(family, dtype=torch.float32)
    _, report = convert_to_mla(model, MLAConfig(kv_ratio=kv_ratio, transfer_epochs=epochs, transfer_batch=2,
                                                **settings), CALIBRATION, progress=False)
    return model, report


@pytest.mark.parametrize("family, dtype, execution", [
    ("llama", "float32", "decompressed"), ("qwen2", "float32", "decompressed"), ("llama", "bfloat16", "decompressed"),
    ("llama", "float32", "absorbed"), ("llama", "bfloat16", "absorbed")])
def test_transfer_lowers_every_layers_output_error_and_reports_it(family, dtype, execution):
    steps = set()  # (execution, output dtype) of every training-step forward (the ones that record gradients)

    def record(module, args, output):
        if isinstance(module, MLAAttention) and torch.is_grad_enabled():
            steps.add((module.execution, (output[0] if isinstance(output, tuple) else output).dtype))

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        model, report = _convert(family, epochs=20, transfer_lr=3e-3, transfer_dtype=dtype,
                                 transfer_execution=execution)
    finally:
        hook.remove()
    assert steps == {(execution, getattr(torch, dtype))}
    for layer in report["layers"]:
        transfer = layer["transfer"]
        assert transfer["steps"] == 20 * 3  # 6 blocks in pieces of 2
        assert transfer["kept"] and transfer["error_after"] < 0.9 * transfer["error_before"], transfer
    assert all(p.grad is None for p in model.parameters())  # no gradient outlives the transfer
    for module in model.modules():  # trained in the transfer's execution, served in the absorbed one, float32
        if isinstance(module, MLAAttention):
            assert module.execution == "absorbed"
            assert all(p.dtype == torch.float32 for p in module.parameters())
    if dtype != "float32":
        # bfloat16 rounds each step's activations by up to 2^-8 (float32: 2^-24, any CPU or thread count), so the
        # trained weights must differ from float32's by more than 2^-12 of their largest entry (measured: 1e-3 to 3e-3)
        float32, _ = _convert(family, epochs=20, transfer_lr=3e-3)
        trained = dict(float32.named_parameters())
        assert any(not torch.allclose(p, trained[name], rtol=0, atol=2 ** -12 * trained[name].abs().max().item())
                   for name, p in model.named_parameters() if "k_up" in name)
        return
    free, free_report = _convert(family, epochs=0)
    assert all(layer["transfer"] is None for layer in free_report["layers"])
    free_state = free.state_dict()
    for name, value in model.state_dict().items():  # only the attention modules were trained
        if ".self_attn." not in name:
            torch.testing.assert_close(value, free_state[name], rtol=0, atol=0, msg=name)
    # the first layer sees the same stream in both runs: its closed form is the same, its transfer error is not
    stream = capture_stream(strong_tiny(family, dtype=torch.float32), adapter_for(free), CALIBRATION, 8)
    original = strong_tiny(family, dtype=torch.float32)
    first = original.model.layers[0]
    batches = attention_batches(first, first.self_attn, stream, adapter_for(original).cache_kwarg)
    errors = [relative_output_error(m.model.layers[0].self_attn, batches) for m in (free, model)]
    assert errors[1] == pytest.approx(report["layers"][0]["transfer"]["error_after"], rel=1e-4)
    assert errors[0] == pytest.approx(report["layers"][0]["transfer"]["error_before"], rel=1e-4)


def test_attention_batches_hold_what_the_attention_saw():
    model = strong_tiny("llama", dtype=torch.float64)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    stream = capture_stream(model, adapter, CALIBRATION, 4)  # batches of 4 and 2 blocks
    batches = attention_batches(layer, adapter.attention(layer), stream, adapter.cache_kwarg)
    assert [b.target.shape[0] for b in batches] == [4, 2]
    assert all(adapter.cache_kwarg not in b.kwargs for b in batches)
    # the original attention on the captured inputs reproduces the captured outputs: error 0
    assert relative_output_error(adapter.attention(layer), batches) == 0.0
    inputs = attention_batches(layer, adapter.attention(layer), stream, adapter.cache_kwarg, targets=False)
    assert all(b.target is None for b in inputs) and len(inputs) == len(batches)
    for seen, full in zip(inputs, batches):  # stopped before the attention, the same inputs
        assert seen.kwargs.keys() == full.kwargs.keys()
        torch.testing.assert_close(seen.kwargs["hidden_states"], full.kwargs["hidden_states"], rtol=0, atol=0)
    pieces = batches[0].split(3)
    assert [p.target.shape[0] for p in pieces] == [3, 1]
    assert pieces[1].kwargs["hidden_states"].shape[0] == 1
    joined = torch.cat([p.kwargs["hidden_states"] for p in pieces])
    torch.testing.assert_close(joined, batches[0].kwargs["hidden_states"], rtol=0, atol=0)
    assert isinstance(pieces[0], AttentionBatch)


def test_an_exact_layer_stays_exact_and_only_mla_modules_change():
    model, report = _convert("llama", epochs=3, kv_ratio=1.0, rope_fraction=0.5, rope_selection="score",
                             damping=1e-9)
    reference, _ = _convert("llama", epochs=0, kv_ratio=1.0, rope_fraction=0.5, rope_selection="score",
                            damping=1e-9)
    # Adam moves an exact layer by about lr per step whatever its gradient: the kept check puts it back
    for layer in report["layers"]:
        assert not layer["transfer"]["kept"] and layer["transfer"]["error_after"] < 1e-8
    for (name, got), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items()):
        torch.testing.assert_close(got, expected, rtol=0, atol=0, msg=name)
    assert all(isinstance(layer.self_attn, MLAAttention) for layer in model.model.layers)


@pytest.mark.parametrize("target", ["teacher", "residual"])
def test_teacher_targets_are_the_original_models_attention_on_its_own_stream(target):
    model, report = _convert("llama", epochs=4, transfer_lr=3e-3, transfer_target=target)
    original = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(original)
    converted_stream = teacher_stream = capture_stream(original, adapter, CALIBRATION, 8)
    converted_layers, original_layers = adapter.decoder_layers(model), adapter.decoder_layers(original)
    for index, (mine, theirs) in enumerate(zip(converted_layers, original_layers)):
        inputs = attention_batches(theirs, theirs.self_attn, converted_stream, adapter.cache_kwarg)
        targets = attention_batches(theirs, theirs.self_attn, teacher_stream, adapter.cache_kwarg)
        streams = (teacher_stream.hidden, converted_stream.hidden) if target == "residual" else None
        batches = teacher_targets(inputs, targets, streams)
        scale = float(inputs[0].target.abs().max())
        difference = float((batches[0].target - inputs[0].target).abs().max())
        if index == 0:  # both streams are the embeddings: the targets are the original attention's own outputs
            assert difference <= 1e-5 * scale  # the same float32 computation twice: rounding at most
        else:  # the converted layers before moved the stream far beyond float32 rounding
            assert difference > 1e-3 * scale
        if target == "residual":  # y_T + (h_T − h), each batch's gap formed on its own
            gap = teacher_stream.hidden[0] - converted_stream.hidden[0]
            torch.testing.assert_close(batches[0].target, targets[0].target + gap, rtol=0, atol=0)
        recorded = report["layers"][index]["transfer"]
        assert relative_output_error(mine.self_attn, batches) == pytest.approx(recorded["error_after"], rel=1e-4)
        assert recorded["kept"] and recorded["error_after"] < recorded["error_before"]
        converted_stream, teacher_stream = converted_stream.advance(mine), teacher_stream.advance(theirs)
    with pytest.raises(ValueError, match="numbers of batches"):
        teacher_targets(inputs + inputs, targets)
    with pytest.raises(ValueError, match="numbers of batches"):
        teacher_targets(inputs, targets, (teacher_stream.hidden * 2, converted_stream.hidden))


def test_transfer_settings_are_checked():
    with pytest.raises(ValueError, match="transfer_target"):
        MLAConfig(transfer_target="student")
    with pytest.raises(ValueError, match="transfer_dtype"):
        MLAConfig(transfer_dtype="float16")
    with pytest.raises(ValueError, match="transfer_execution"):
        MLAConfig(transfer_execution="naive")
    for bad in ({"transfer_epochs": -1}, {"transfer_batch": 0}, {"transfer_lr": 0.0}):
        with pytest.raises(ValueError, match="transfer"):
            MLAConfig(**bad)


@pytest.mark.parametrize("target, mlp_lr", [("converted", 0.0), ("residual", 0.0), ("residual", 1e-3)])
def test_an_interrupted_conversion_resumes_to_the_same_model(tmp_path, monkeypatch, target, mlp_lr):
    import retrofitter.pipelines.mla as mla_pipeline

    config = MLAConfig(kv_ratio=0.25, transfer_epochs=2, transfer_batch=2, transfer_target=target,
                       mlp_transfer_lr=mlp_lr)
    reference = strong_tiny("llama", dtype=torch.float32)
    _, expected_report = convert_to_mla(reference, config, CALIBRATION, progress=False)
    build, calls = mla_pipeline.mla_attention_from_factors, []

    def failing_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # the run stops inside layer 1
        return build(*args, **kwargs)

    monkeypatch.setattr(mla_pipeline, "mla_attention_from_factors", failing_second_layer)
    work = tmp_path / "partial"
    with pytest.raises(KeyboardInterrupt):
        convert_to_mla(strong_tiny("llama", dtype=torch.float32), config, CALIBRATION, progress=False,
                       checkpoint_dir=work)
    assert (work / "layer_0.safetensors").is_file() and not (work / "layer_1.safetensors").exists()
    assert (work / "teacher_stream.safetensors").is_file() == (target != "converted")
    calls.clear()
    model, report = convert_to_mla(strong_tiny("llama", dtype=torch.float32), config, CALIBRATION, progress=False,
                                   checkpoint_dir=work)
    assert len(calls) == 1  # only layer 1 was converted again
    assert not work.exists()  # removed once the run completed
    assert report["layers"][0]["transfer"]["error_after"] == expected_report["layers"][0]["transfer"]["error_after"]
    expected = reference.state_dict()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=name)
    with pytest.raises(Exception, match="different run"):  # another run's work directory is never reused
        bad = tmp_path / "other"
        monkeypatch.setattr(mla_pipeline, "mla_attention_from_factors", failing_second_layer)
        calls.clear()
        with pytest.raises(KeyboardInterrupt):
            convert_to_mla(strong_tiny("llama", dtype=torch.float32), config, CALIBRATION, progress=False,
                           checkpoint_dir=bad)
        convert_to_mla(strong_tiny("llama", dtype=torch.float32), MLAConfig(kv_ratio=0.5), CALIBRATION,
                       progress=False, checkpoint_dir=bad)


def test_skipped_position_ids_keep_order_and_reach_the_context():
    ids = skipped_position_ids(64, 32, 200, torch.Generator().manual_seed(0))
    steps = ids[:, 1:] - ids[:, :-1]
    assert ids.shape == (64, 32) and bool((ids[:, 0] == 0).all())
    assert bool((steps >= 1).all()) and bool(((steps > 1).sum(1) <= 1).all())  # one cut, order kept
    assert int(ids.max()) <= 199 and int(ids[:, -1].max()) > 150  # skips reach far into the context
    torch.testing.assert_close(skipped_position_ids(3, 32, 32, torch.Generator()), torch.arange(32).expand(3, 32))
    with pytest.raises(ValueError, match="context"):
        skipped_position_ids(2, 32, 31, torch.Generator())


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_targets_at_skipped_positions_are_the_models_own_attention_there(family):
    """Layer 0's attention rerun at skipped positions equals what the HF model computes when given those
    position ids (its own rotary tables), and differs from the targets at positions 0 … n − 1."""
    model = strong_tiny(family, dtype=torch.float32)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    stream = capture_stream(model, adapter, CALIBRATION, 8)
    batches = attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg)
    ids = skipped_position_ids(*CALIBRATION.shape, 200, torch.Generator().manual_seed(3))
    moved = at_positions(batches, [ids], functools.partial(attention_kwargs_at, model), layer.self_attn)
    seen = []
    hook = layer.self_attn.register_forward_hook(lambda _m, _a, out: seen.append(out[0]))
    with torch.no_grad():
        model(CALIBRATION, position_ids=ids)
    hook.remove()
    scale = float(seen[0].abs().max())
    torch.testing.assert_close(moved[0].target, seen[0], rtol=0, atol=1e-5 * scale)
    assert float((moved[0].target - batches[0].target).abs().max()) > 1e-3 * scale
    inputs = at_positions(attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg, targets=False),
                          [ids], functools.partial(attention_kwargs_at, model))
    assert inputs[0].target is None
    torch.testing.assert_close(inputs[0].kwargs["position_embeddings"][0], moved[0].kwargs["position_embeddings"][0])
    with pytest.raises(ValueError, match="position-id"):
        at_positions(batches, [], functools.partial(attention_kwargs_at, model))


@pytest.mark.parametrize("target", ["residual", "converted"])
def test_transfer_at_skipped_positions_trains_on_those_positions(target):
    """With a transfer context each layer's recorded errors are those of its batches at the seeded skipped
    positions (rebuilt here), it still lowers them, and the model differs from the run without."""
    model, report = _convert("llama", epochs=4, transfer_lr=3e-3, transfer_target=target, transfer_context=200)
    plain, _ = _convert("llama", epochs=4, transfer_lr=3e-3, transfer_target=target)
    original = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(original)
    layer, mine = adapter.decoder_layers(original)[0], adapter.decoder_layers(model)[0]
    stream = capture_stream(original, adapter, CALIBRATION, 8)  # layer 0: both streams are the embeddings
    ids = skipped_position_ids(*CALIBRATION.shape, 200, torch.Generator().manual_seed(0))
    batches = at_positions(attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg), [ids],
                           functools.partial(attention_kwargs_at, original), layer.self_attn)
    recorded = report["layers"][0]["transfer"]
    assert relative_output_error(mine.self_attn, batches) == pytest.approx(recorded["error_after"], rel=1e-4)
    for layer_report in report["layers"]:
        assert layer_report["transfer"]["kept"]
        assert layer_report["transfer"]["error_after"] < layer_report["transfer"]["error_before"]
    difference = max(float((a - b).abs().max()) for a, b in zip(model.state_dict().values(),
                                                                   plain.state_dict().values()))
    assert difference > 1e-4


def test_transfer_context_is_checked_against_the_blocks_and_the_model():
    with pytest.raises(ValueError, match="transfer_context"):
        MLAConfig(transfer_context=-1)
    for context in (31, 257):  # blocks of 32 tokens; the tiny model's max_position_embeddings is 256
        with pytest.raises(ValueError, match="--transfer-context"):
            _convert("llama", epochs=1, transfer_context=context)


def test_repeated_spans_calibrate_the_conversion_on_the_blocks_with_repeats(monkeypatch):
    """--repeat-share converts on the calibration with repeated spans (data/blocks.py): every stream the conversion
    captures reads exactly those token ids, the weights match the conversion given that calibration directly (within
    what rounding can move them, below), and differ from the plain one's."""
    seen = []  # the token ids of every calibration stream the conversion captures (integers: exact on any CPU)
    real_capture = mla_pipeline.capture_stream

    def capture(model, adapter, calibration, batch_size):
        seen.append(calibration.clone())
        return real_capture(model, adapter, calibration, batch_size)

    monkeypatch.setattr(mla_pipeline, "capture_stream", capture)
    repeated, report = _convert("llama", epochs=1, repeat_share=0.5, repeat_span=8)
    monkeypatch.undo()
    with_repeats = with_repeated_spans(CALIBRATION, 0.5, 8)
    # integer token ids (int64 on both sides, copied by indexing): torch.equal is exact on every CPU
    assert with_repeats.dtype == torch.long
    assert seen and all(ids.dtype == torch.long and torch.equal(ids, with_repeats) for ids in seen)
    given = strong_tiny("llama", dtype=torch.float32)
    convert_to_mla(given, MLAConfig(kv_ratio=0.25, transfer_epochs=1, transfer_batch=2), with_repeats,
                   progress=False)
    plain, _ = _convert("llama", epochs=1)
    expected, baseline = given.state_dict(), plain.state_dict()
    # Same inputs and code; only the order of float32 roundings may differ between runs (MKL picks kernels by memory
    # alignment). The closed form moves by rounding times the fit's conditioning; each of the 3 Adam steps (6 blocks
    # in pieces of 2, one epoch) moves a weight by at most about lr = 3e-3, so a flipped update is bounded by 3 * lr.
    for name, tensor in repeated.state_dict().items():
        torch.testing.assert_close(tensor, expected[name], rtol=1e-4, atol=3 * 3e-3)
    # the plain calibration moves the weights by far more than that bound (measured: 2.8)
    assert max(float((t - baseline[n]).abs().max()) for n, t in repeated.state_dict().items()) > 10 * 3 * 3e-3
    assert report["config"]["repeat_share"] == 0.5 and report["config"]["repeat_span"] == 8
    for bad in ({"repeat_share": -0.1}, {"repeat_share": 1.1}, {"repeat_span": 0}):
        with pytest.raises(ValueError, match="repeat"):
            MLAConfig(**bad)


def test_kl_query_rows_are_every_fourth_ending_with_the_last():
    assert kl_query_rows(10).tolist() == [1, 5, 9] and kl_query_rows(4).tolist() == [3]


def test_attention_kl_is_the_kl_divergence_of_each_row():
    generator = torch.Generator().manual_seed(5)
    scores = torch.randn(2, 3, 6, 6, generator=generator, dtype=torch.float64)
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    p = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)  # masked entries exactly 0
    q = torch.softmax(torch.randn(2, 3, 6, 6, generator=generator, dtype=torch.float64).masked_fill(
        ~causal, float("-inf")), -1)
    expected = sum(float((p[b, h, i, :i + 1] * (p[b, h, i, :i + 1] / q[b, h, i, :i + 1]).log()).sum())
                   for b in range(2) for h in range(3) for i in range(6)) / (2 * 3 * 6)
    # float32 inside (the loss's dtype): terms of order 1 rounded to 2^-24
    assert float(attention_kl(p, q)) == pytest.approx(expected, rel=1e-5)
    assert float(attention_kl(p, p)) == pytest.approx(0.0, abs=1e-6)
    q_zero = q.clone()
    q_zero[..., 0, 0] = 0.0  # an underflowed weight where the reference has mass: large and finite
    assert torch.isfinite(attention_kl(p, q_zero)) and float(attention_kl(p, q_zero)) > expected


def test_the_attention_kl_term_lowers_the_kl_and_is_recorded():
    """--transfer-kl: every layer's recorded KL falls; layer 0's recomputed KL (both streams are the embeddings, so
    the reference is the original attention on the same inputs) equals the record and lies below the KL of the run
    trained on the output error alone."""
    model, report = _convert("llama", epochs=20, transfer_kl=1.0)
    plain, plain_report = _convert("llama", epochs=20)
    assert all("kl_after" not in layer["transfer"] for layer in plain_report["layers"])
    for layer in report["layers"]:
        transfer = layer["transfer"]
        assert transfer["kept"] and transfer["kl_after"] < transfer["kl_before"], transfer
    original = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(original)
    first = adapter.decoder_layers(original)[0]
    batches = attention_batches(first, first.self_attn, capture_stream(original, adapter, CALIBRATION, 8),
                                adapter.cache_kwarg)
    references = reference_weights_at_rows(batches, functools.partial(attention_probabilities, original,
                                                                      first.self_attn))
    assert references[0].shape == (6, 4, 8, 32)  # every 4th of the 32 queries, the last included
    trained, untrained = (mean_attention_kl(m.model.layers[0].self_attn, batches, references) for m in (model, plain))
    assert trained == pytest.approx(report["layers"][0]["transfer"]["kl_after"], rel=1e-4)
    assert trained < untrained
    assert model.model.layers[0].self_attn.execution == "absorbed"  # the measurement put the serving one back
    # layer 1: the reference is the original attention on the original model's own stream, not the converted one
    second, stream = adapter.decoder_layers(original)[1], capture_stream(original, adapter, CALIBRATION, 8)
    converted_stream, teacher_stream = stream.advance(model.model.layers[0]), stream.advance(first)
    inputs = attention_batches(second, second.self_attn, converted_stream, adapter.cache_kwarg, targets=False)
    teacher = attention_batches(second, second.self_attn, teacher_stream, adapter.cache_kwarg)
    batches = teacher_targets(inputs, teacher, (teacher_stream.hidden, converted_stream.hidden))
    weights = functools.partial(attention_probabilities, original, second.self_attn)
    references = reference_weights_at_rows(batches, weights)
    on_converted = weights(inputs[0].kwargs)[:, :, kl_query_rows(32)]
    assert float((references[0] - on_converted).abs().max()) > 1e-4
    recomputed = mean_attention_kl(model.model.layers[1].self_attn, batches, references)
    assert recomputed == pytest.approx(report["layers"][1]["transfer"]["kl_after"], rel=1e-4)


@pytest.mark.parametrize("kl", [0.0, 1.0])
def test_a_layers_transfer_holds_its_inputs_and_targets_and_the_teachers_inputs_only_for_the_kl(monkeypatch, kl):
    """The memory docs/scaling.md states: the batches a layer trains on hold two copies of its n·T·d float32 stream
    (inputs, targets), three with --transfer-kl (the original's inputs, its reference)."""
    held = []
    real = mla_pipeline.transfer_attention

    def recording(module, batches, **kwargs):
        tensors = [t for b in batches for t in (b.kwargs["hidden_states"], b.target)]
        tensors += [b.reference["hidden_states"] for b in batches if b.reference is not None]
        held.append({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors})
        return real(module, batches, **kwargs)

    monkeypatch.setattr(mla_pipeline, "transfer_attention", recording)
    model, _ = _convert("llama", epochs=1, transfer_context=200, transfer_kl=kl)
    copy = CALIBRATION.numel() * model.config.hidden_size * 4
    assert len(held) == model.config.num_hidden_layers
    assert all(sum(storages.values()) == (3 if kl else 2) * copy for storages in held)


def test_each_layer_hands_the_freed_heap_back_after_its_transfer_data_is_gone(monkeypatch):
    """RSS would otherwise creep from layer to layer (glibc keeps freed blocks): the heap is released once per layer,
    after that layer's inputs and targets are freed."""
    targets, released = [], []
    real = mla_pipeline.transfer_attention

    def recording(module, batches, **kwargs):
        targets.append(weakref.ref(batches[0].target))
        return real(module, batches, **kwargs)

    monkeypatch.setattr(mla_pipeline, "transfer_attention", recording)
    monkeypatch.setattr(mla_pipeline, "release_free_heap_memory",
                        lambda: released.append((len(targets), all(t() is None for t in targets))))
    model, _ = _convert("llama", epochs=1)
    layers = model.config.num_hidden_layers
    assert released == [(index + 1, True) for index in range(layers)]


@pytest.mark.parametrize("kl", [0.0, 1.0])
def test_the_teacher_stream_advances_in_place_and_converts_the_same_model(monkeypatch, kl):
    """Past layer 0 the original model's stream goes through its layer in place: each old batch is freed as its
    output replaces it (nothing else holds it, the KL reference included), so the layer's peak holds no third
    stream beside its inputs and targets; the converted model is the one plain ``advance`` gives."""
    freed, in_place_streams, plain_streams = [], [], []
    real = LayerStream.advance_in_place

    def checking(self, layer):
        old = [weakref.ref(h) for h in self.hidden]
        out = real(self, layer)
        freed.append(all(r() is None for r in old))
        in_place_streams.append([h.clone() for h in out.hidden])
        return out

    def plain_advance(self, layer):
        out = LayerStream.advance(self, layer)
        plain_streams.append([h.clone() for h in out.hidden])
        return out

    monkeypatch.setattr(LayerStream, "advance_in_place", checking)
    model, _ = _convert("llama", epochs=1, transfer_kl=kl, mlp_transfer_lr=1e-3)  # the MLP's targets read h_T
    assert freed == [True] * (model.config.num_hidden_layers - 1)
    monkeypatch.setattr(LayerStream, "advance_in_place", plain_advance)
    plain, _ = _convert("llama", epochs=1, transfer_kl=kl, mlp_transfer_lr=1e-3)
    # h_T is the original model's stream, untouched by the training: the same layer forwards on the same inputs,
    # so the two runs' h_T differ at most by the rounding of a reordered reduction (a few ulp)
    assert len(in_place_streams) == len(plain_streams) == model.config.num_hidden_layers - 1
    for ours, theirs in zip(in_place_streams, plain_streams):
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the models trained on them: h_T off by 2 ulp (× (1 + 2^-22)) moves this model's weights by 1.3e-5 at most
    # after the epoch of Adam, h_T off by 1 % by 2e-3 (both measured); 2e-4 lies between
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-4)


def test_advance_in_place_is_advance():
    model = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(model)
    stream = capture_stream(model, adapter, CALIBRATION, 4)  # batches of 4 and 2 blocks
    layer = adapter.decoder_layers(model)[0]
    expected = stream.advance(layer)
    hidden = stream.hidden
    assert stream.advance_in_place(layer) is stream and stream.hidden is hidden  # the same list, new tensors
    # the same function on the same tensors (both run `_replace_by_outputs`, advance on a new list): equal up to
    # the rounding of a reordered reduction, should a kernel reorder one (a few ulp)
    assert len(stream.hidden) == len(expected.hidden) == len(hidden) == 2
    for a, b in zip(stream.hidden, expected.hidden):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert expected.hidden is not hidden  # advance leaves its own stream's list alone


def test_teacher_targets_from_an_iterator_hold_one_teacher_batch_at_a_time():
    """Fed by ``iter_attention_batches`` (as the pipeline does), each teacher batch's inputs and outputs are freed
    once its residual target is formed, and the targets equal those from the list."""
    model = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    stream = capture_stream(model, adapter, CALIBRATION, 2)  # 3 batches of 2 blocks
    converted = stream.advance(layer)  # any other stream of the same shapes
    inputs = attention_batches(layer, layer.self_attn, converted, adapter.cache_kwarg, targets=False)
    alive = []

    def watched():
        for batch in iter_attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg):
            assert all(ref() is None for ref in alive)  # the previous batch's tensors are gone
            alive[:] = [weakref.ref(batch.kwargs["hidden_states"]), weakref.ref(batch.target)]
            yield batch

    streams = (stream.hidden, converted.hidden)
    batches = teacher_targets(inputs, watched(), streams, keep_reference=False)
    expected = teacher_targets(inputs, attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg), streams)
    assert len(batches) == 3 and all(ref() is None for ref in alive)
    for got, want in zip(batches, expected):
        torch.testing.assert_close(got.target, want.target, rtol=0, atol=0)  # the same elementwise sums
    with pytest.raises(ValueError, match="numbers of batches"):
        teacher_targets(inputs, iter(expected[:2]), streams)


def test_teacher_targets_keep_the_teachers_inputs_as_the_reference_and_split_them():
    model = strong_tiny("llama", dtype=torch.float32)
    adapter = adapter_for(model)
    layer = adapter.decoder_layers(model)[0]
    stream = capture_stream(model, adapter, CALIBRATION, 8)
    inputs = attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg, targets=False)
    teacher = attention_batches(layer, layer.self_attn, stream, adapter.cache_kwarg)
    batch = teacher_targets(inputs, teacher)[0]
    assert batch.reference is teacher[0].kwargs and inputs[0].reference_kwargs is inputs[0].kwargs
    unreferenced = teacher_targets(inputs, teacher, keep_reference=False)[0]  # no attention-weights term to read it
    assert unreferenced.reference is None and unreferenced.target is teacher[0].target
    pieces = batch.split(4)
    assert [p.reference["hidden_states"].shape[0] for p in pieces] == [4, 2]
    torch.testing.assert_close(pieces[1].reference["hidden_states"], teacher[0].kwargs["hidden_states"][4:],
                               rtol=0, atol=0)


def test_the_attention_kl_needs_the_decompressed_execution():
    with pytest.raises(ValueError, match="transfer_kl"):
        MLAConfig(transfer_kl=-1.0)
    with pytest.raises(ValueError, match="decompressed"):
        MLAConfig(transfer_kl=1.0, transfer_execution="absorbed")
    module = torch.nn.Linear(2, 2)  # refused before any use of the module or the batches
    with pytest.raises(ValueError, match="decompressed"):
        transfer_attention(module, [], epochs=1, lr=1e-3, batch_blocks=1, kl_weight=1.0, execution="absorbed",
                           reference_weights=lambda kwargs: None)
    with pytest.raises(ValueError, match="reference_weights"):
        transfer_attention(module, [], epochs=1, lr=1e-3, batch_blocks=1, kl_weight=1.0)


@pytest.mark.parametrize("native", [True, False])
def test_the_conversion_trains_in_the_resolved_dtype_and_reports_it(monkeypatch, native):
    import retrofitter.pipelines.training as training_module

    monkeypatch.setattr(training_module, "native_bfloat16", lambda device: native)  # over conftest's False
    steps = set()

    def record(module, args, output):
        if isinstance(module, MLAAttention) and torch.is_grad_enabled():
            steps.add((output[0] if isinstance(output, tuple) else output).dtype)

    hook = torch.nn.modules.module.register_module_forward_hook(record)
    try:
        _, report = _convert("llama", epochs=1, transfer_dtype="auto")
    finally:
        hook.remove()
    expected = "bfloat16" if native else "float32"
    assert steps == {getattr(torch, expected)} and report["transfer_dtype"] == expected
    assert report["config"]["transfer_dtype"] == "auto"
