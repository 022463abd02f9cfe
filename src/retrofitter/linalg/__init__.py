"""Pure tensor math for LatentLLM compression (no nn.Module, no HF).

moments          streaming E[x], E[x xᵀ], E[a bᵀ] in float64
preconditioners  registry of P for min ‖(W − BA)P‖ (plain, hessian, l2, cov, rootcov, cholesky)
svd              weighted_low_rank / rootcov_svd, bias compensation, proxy error
junction         block-identity factorization of B A (QR with column pivoting)
ranks            ranks from parameter budgets
tucker           alternating Tucker-2 of factored per-head matrices
joint_qk         joint query/key solver (Algorithm 1, corrected transpose; GQA; RoPE option)
joint_vo         joint value/output solver
joint_mlp        streaming down refit; auxiliary-variable joint MLP (ReLU, gated SiLU/GELU)
"""

from .joint_mlp import down_fit_error, fit_down_to_compressed, joint_gated_mlp, joint_mlp_relu
from .teacher_target import fit_low_rank_map, teacher_target_factors, teacher_target_map
from .joint_qk import JointQKFactors, JointQKSolver, gqa_group_index, rope_relative_rotations
from .joint_vo import JointVOFactors, JointVOSolver
from .junction import JunctionFactors, assemble_down, junction_factor, junction_param_count
from .moments import CrossMomentAccumulator, SecondMomentAccumulator, damped
from .preconditioners import PRECONDITIONERS, Preconditioner, make_preconditioner
from .ranks import (
    check_useful_rank,
    factor_param_count,
    max_useful_rank,
    rank_for_group_budget,
    rank_for_keep_fraction,
    rank_for_ratio,
)
from .svd import bias_compensation, proxy_error, rootcov_svd, weighted_low_rank

__all__ = [
    "CrossMomentAccumulator",
    "JointQKFactors",
    "JointQKSolver",
    "JointVOFactors",
    "JointVOSolver",
    "JunctionFactors",
    "PRECONDITIONERS",
    "Preconditioner",
    "SecondMomentAccumulator",
    "assemble_down",
    "bias_compensation",
    "check_useful_rank",
    "damped",
    "factor_param_count",
    "down_fit_error",
    "fit_down_to_compressed",
    "fit_low_rank_map",
    "teacher_target_factors",
    "teacher_target_map",
    "gqa_group_index",
    "joint_gated_mlp",
    "joint_mlp_relu",
    "junction_factor",
    "junction_param_count",
    "make_preconditioner",
    "max_useful_rank",
    "proxy_error",
    "rank_for_group_budget",
    "rank_for_keep_fraction",
    "rank_for_ratio",
    "rootcov_svd",
    "rope_relative_rotations",
    "weighted_low_rank",
]
