"""The GEMMs published models run: the problems of `bench_matmul --suite=models`.

`MODELS` holds the sizes of each model's Hugging Face config.json that set its
GEMMs, `WORKLOADS` which of its steps the suite takes. Weights are stored (K, N),
as JAX layers store them, so a step's products are, for a weight W (K, N) and
T tokens:

  forward    x (T, K) @ W (K, N):          m=T, k=K, n=N, NN;
  d input    g (T, N) @ W^T, W as stored:  m=T, k=N, n=K, NT;
  d weight   x^T @ g, x as stored (T, K):  m=K, k=T, n=N, TN.

The weights: the attention projections (q, k and v fused: N = (heads + 2 *
kv_heads) * head_dim; the output projection), the MLP (gate and up fused, N = 2
* intermediate, where it is gated; down), the LM head (N = the vocabulary),
the experts of a mixture of experts (forward only, at the tokens a router gives
one expert: balanced, tokens * experts_per_token / num_experts, and 4x that,
capped at the tokens) and LoRA adapters, A (hidden, r) and B (r, out).

The families are split into a fit half and a check half (`FIT_FAMILIES`,
`CHECK_FAMILIES`): constants are fitted on the first and judged on the second.
Problems of identical (m, k, n, layout) are merged, keeping every model, role
and step; one that models of both halves run belongs to the fit half (it was
fitted on), so the check half holds only problems the fit half does not.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Iterator

from pipelines.operands import NN, OperandLayout

NT = OperandLayout(transpose_rhs=True)
TN = OperandLayout(transpose_lhs=True)

TRAIN_FORWARD = "train_forward"
TRAIN_D_INPUT = "train_d_input"
TRAIN_D_WEIGHT = "train_d_weight"
PREFILL = "prefill"
DECODE = "decode"
STEPS = (TRAIN_FORWARD, TRAIN_D_INPUT, TRAIN_D_WEIGHT, PREFILL, DECODE)
HALVES = ("fit", "check")

# A training step's tokens: one 4096-token sequence, or two of 2048, per micro-batch.
TRAIN_TOKENS = 4096
# A prefill's tokens: a chunk of prompts, as chunked-prefill servers batch them. Half the
# training count, so that prefill and training give different M.
PREFILL_TOKENS = 2048
# The skewed router: the busiest expert gets this many times the balanced count.
SKEWED_EXPERT_FACTOR = 4


@dataclasses.dataclass(frozen=True, kw_only=True)
class MixtureOfExperts:
  """The routed MLP of a model (its experts gated where the model's MLP is).

  Attributes:
    num_experts: routed experts per layer.
    experts_per_token: experts each token is routed to.
    expert_intermediate: an expert's intermediate size.
    shared_intermediate: the intermediate size of the shared experts, all of
      them together (one MLP every token passes through); 0 where none.
  """

  num_experts: int
  experts_per_token: int
  expert_intermediate: int
  shared_intermediate: int = 0

  def expert_tokens(self, tokens: int) -> tuple[int, ...]:
    """The tokens of the busiest expert: a balanced router's, then a skewed one's."""
    balanced = math.ceil(tokens * self.experts_per_token / self.num_experts)
    skewed = min(tokens, SKEWED_EXPERT_FACTOR * balanced)
    return (balanced,) if skewed == balanced else (balanced, skewed)


@dataclasses.dataclass(frozen=True, kw_only=True)
class LatentAttention:
  """DeepSeek-V2's multi-head latent attention, without a query compression
  (q_lora_rank null): q_proj, kv_a_proj_with_mqa, kv_b_proj and o_proj."""

  kv_lora_rank: int
  qk_nope_head_dim: int
  qk_rope_head_dim: int
  v_head_dim: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
  """The sizes of a published model that set its GEMMs (its config.json).

  Attributes:
    name: the model, as its repository names it.
    family: the models released together with one architecture; a family is
      all in one half.
    hidden: hidden_size.
    intermediate: intermediate_size of the dense MLP; None where every layer's
      MLP is a mixture of experts.
    num_heads, num_kv_heads, head_dim: the attention heads (head_dim, where the
      config has none, is hidden / num_heads).
    vocab: vocab_size, the LM head's N.
    gated: whether the MLP is gated (SwiGLU, GeGLU: gate and up fused) or one
      up projection.
    moe: the routed experts, if any.
    latent_attention: where set, the attention projections are these instead of
      the fused qkv.
  """

  name: str
  family: str
  hidden: int
  intermediate: int | None
  num_heads: int
  num_kv_heads: int
  head_dim: int
  vocab: int
  gated: bool = True
  moe: MixtureOfExperts | None = None
  latent_attention: LatentAttention | None = None

  def __post_init__(self):
    sizes = dict(hidden=self.hidden, num_heads=self.num_heads, num_kv_heads=self.num_kv_heads,
                 head_dim=self.head_dim, vocab=self.vocab)
    if self.intermediate is not None:
      sizes["intermediate"] = self.intermediate
    for part in (self.moe, self.latent_attention):
      sizes.update(dataclasses.asdict(part) if part else {})
    sizes.pop("shared_intermediate", None)  # May be 0.
    bad = {k: v for k, v in sizes.items() if v < 1}
    if bad:
      raise ValueError(f"{self.name}: sizes must be positive, got {bad}")
    if self.intermediate is None and self.moe is None:
      raise ValueError(f"{self.name} has neither a dense MLP nor experts")

  @property
  def q_width(self) -> int:
    """The query projection's N (the attention's width)."""
    return self.num_heads * self.head_dim


# The published configs, each from the config.json of the repository its comment names.
MODELS = (
    # meta-llama/Llama-3.2-1B
    ModelConfig(name="Llama-3.2-1B", family="Llama 3", hidden=2048, intermediate=8192,
                num_heads=32, num_kv_heads=8, head_dim=64, vocab=128256),
    # meta-llama/Meta-Llama-3-8B
    ModelConfig(name="Llama-3-8B", family="Llama 3", hidden=4096, intermediate=14336,
                num_heads=32, num_kv_heads=8, head_dim=128, vocab=128256),
    # meta-llama/Meta-Llama-3-70B
    ModelConfig(name="Llama-3-70B", family="Llama 3", hidden=8192, intermediate=28672,
                num_heads=64, num_kv_heads=8, head_dim=128, vocab=128256),
    # mistralai/Mistral-7B-v0.1
    ModelConfig(name="Mistral-7B", family="Mistral", hidden=4096, intermediate=14336,
                num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000),
    # mistralai/Mixtral-8x7B-v0.1: every MLP is routed (num_local_experts, intermediate_size).
    ModelConfig(name="Mixtral-8x7B", family="Mixtral", hidden=4096, intermediate=None,
                num_heads=32, num_kv_heads=8, head_dim=128, vocab=32000,
                moe=MixtureOfExperts(num_experts=8, experts_per_token=2,
                                     expert_intermediate=14336)),
    # Qwen/Qwen1.5-MoE-A2.7B: every MLP is routed (decoder_sparse_step 1), beside one
    # shared expert (shared_expert_intermediate_size).
    ModelConfig(name="Qwen1.5-MoE-A2.7B", family="Qwen1.5-MoE", hidden=2048, intermediate=None,
                num_heads=16, num_kv_heads=16, head_dim=128, vocab=151936,
                moe=MixtureOfExperts(num_experts=60, experts_per_token=4,
                                     expert_intermediate=1408, shared_intermediate=5632)),
    # microsoft/Phi-3-mini-4k-instruct (qkv_proj and gate_up_proj fused as published).
    ModelConfig(name="Phi-3-mini", family="Phi-3", hidden=3072, intermediate=8192,
                num_heads=32, num_kv_heads=32, head_dim=96, vocab=32064),
    # Qwen/Qwen2.5-7B
    ModelConfig(name="Qwen2.5-7B", family="Qwen2.5", hidden=3584, intermediate=18944,
                num_heads=28, num_kv_heads=4, head_dim=128, vocab=152064),
    # Qwen/Qwen2.5-32B
    ModelConfig(name="Qwen2.5-32B", family="Qwen2.5", hidden=5120, intermediate=27648,
                num_heads=40, num_kv_heads=8, head_dim=128, vocab=152064),
    # google/gemma-2-2b
    ModelConfig(name="Gemma-2-2B", family="Gemma 2", hidden=2304, intermediate=9216,
                num_heads=8, num_kv_heads=4, head_dim=256, vocab=256000),
    # google/gemma-2-27b
    ModelConfig(name="Gemma-2-27B", family="Gemma 2", hidden=4608, intermediate=36864,
                num_heads=32, num_kv_heads=16, head_dim=128, vocab=256000),
    # deepseek-ai/DeepSeek-V2-Lite: latent attention as published (q_lora_rank null); the
    # first layer's MLP is dense (first_k_dense_replace 1, intermediate_size), the others
    # routed beside 2 shared experts (n_shared_experts x moe_intermediate_size). head_dim is
    # the query's and key's (qk_nope_head_dim + qk_rope_head_dim); no GEMM reads it.
    ModelConfig(name="DeepSeek-V2-Lite", family="DeepSeek-V2", hidden=2048, intermediate=10944,
                num_heads=16, num_kv_heads=16, head_dim=192, vocab=102400,
                moe=MixtureOfExperts(num_experts=64, experts_per_token=6,
                                     expert_intermediate=1408, shared_intermediate=2 * 1408),
                latent_attention=LatentAttention(kv_lora_rank=512, qk_nope_head_dim=128,
                                                 qk_rope_head_dim=64, v_head_dim=128)),
    # tiiuae/falcon-7b: multi-query attention (one kv head), a gelu MLP of 4 * hidden (the
    # config gives no ffn_hidden_size; that is FalconConfig's default).
    ModelConfig(name="Falcon-7B", family="Falcon", hidden=4544, intermediate=4 * 4544,
                num_heads=71, num_kv_heads=1, head_dim=64, vocab=65024, gated=False),
    # allenai/OLMo-2-1124-7B
    ModelConfig(name="OLMo-2-7B", family="OLMo 2", hidden=4096, intermediate=11008,
                num_heads=32, num_kv_heads=32, head_dim=128, vocab=100352),
)

# The split, chosen before any constant was fitted; never move a family between halves.
# Each half has small and large dense models (fit 1-70B, check 2-32B), an MoE model,
# LM heads (fit 32k-152k words, check 65k-256k), decode and LoRA. Families whose GEMMs
# coincide (Llama 3 8B, Mistral 7B and Mixtral share attention, MLP and LM head sizes)
# are on one side, so that the check half is not the fit half again.
FIT_FAMILIES = ("Llama 3", "Mistral", "Mixtral", "Qwen1.5-MoE", "Phi-3")
CHECK_FAMILIES = ("Qwen2.5", "Gemma 2", "DeepSeek-V2", "Falcon", "OLMo 2")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
  """The steps of a model the suite takes.

  Attributes:
    train: a training step at TRAIN_TOKENS (forward, d input, d weight; the
      experts' forward only).
    prefill: a prefill at PREFILL_TOKENS (forward).
    decode_batches: decode steps at these batch sizes (forward).
    lora_ranks: LoRA adapters of these ranks trained at TRAIN_TOKENS (forward,
      d input, d weight of A and B).
    lora_target: the projection the adapters are on: "q" or "gate".
  """

  train: bool = False
  prefill: bool = False
  decode_batches: tuple[int, ...] = ()
  lora_ranks: tuple[int, ...] = ()
  lora_target: str = "q"

  def __post_init__(self):
    if self.lora_target not in ("q", "gate"):
      raise ValueError(f"lora_target must be 'q' or 'gate', got {self.lora_target!r}")
    if min(self.decode_batches + self.lora_ranks, default=1) < 1:
      raise ValueError(f"batches and ranks must be positive: {self}")


# A training step is 15 GEMMs a model (5 weights x 3 products), a prefill or a decode
# batch 5: every step of every model would be about 700 problems, and each half may have
# about 80 (each costs seconds of GPU time per dtype). So each model takes the steps it is
# most often run in at its size, and each half gets the same mix:
#   - a training step of a 7-8B dense model and, in the fit half, of an MoE model (one
#     GPU fine-tunes them); the larger models are served;
#   - LoRA adapters trained with it, their backward included (the narrow shapes: N or K
#     the rank, M the rank with a K of the tokens), ranks interleaved between the halves
#     (fit 8 and 32 on a q projection, check 16 and 64 on a gate projection);
#   - prefills of the large dense models and of an MoE model (its experts at the router's
#     counts of the prefill's tokens);
#   - decode at 1, 16, 64 and 256 in each half, each at another hidden size, a large model
#     at a small batch and a small one at a large batch; where both halves have a hidden
#     size, they decode it at different batches (4096: Mixtral at 64, OLMo 2 at 16), so
#     that no check problem is a fit one.
WORKLOADS = {
    "Llama-3.2-1B": Workload(decode_batches=(256,)),
    "Llama-3-8B": Workload(train=True, lora_ranks=(8, 32)),
    "Llama-3-70B": Workload(prefill=True, decode_batches=(16,)),
    # Mistral 7B's GEMMs at a token count are Mixtral's (its MLP is the skewed expert's,
    # where that gets every token): it adds no problem, only its name.
    "Mistral-7B": Workload(prefill=True, decode_batches=(64,)),
    "Mixtral-8x7B": Workload(prefill=True, decode_batches=(64,)),
    "Qwen1.5-MoE-A2.7B": Workload(train=True),
    "Phi-3-mini": Workload(decode_batches=(1,)),
    "Qwen2.5-7B": Workload(train=True, decode_batches=(64,), lora_ranks=(16, 64),
                           lora_target="gate"),
    "Qwen2.5-32B": Workload(prefill=True, decode_batches=(16,)),
    "Gemma-2-2B": Workload(decode_batches=(256,)),
    "Gemma-2-27B": Workload(prefill=True),
    "DeepSeek-V2-Lite": Workload(prefill=True),
    "Falcon-7B": Workload(decode_batches=(1,)),
    "OLMo-2-7B": Workload(decode_batches=(16,)),
}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """One GEMM of the suite, out (m, n) = op(lhs) (m, k) @ op(rhs) (k, n), and where it
  comes from: the models, the weights' roles and the steps that run it."""

  m: int
  k: int
  n: int
  layout: OperandLayout
  half: str
  models: tuple[str, ...]
  roles: tuple[str, ...]
  steps: tuple[str, ...]


def family_half(family: str) -> str:
  """"fit" or "check"; raises ValueError for a family in neither half."""
  if family in FIT_FAMILIES:
    return "fit"
  if family in CHECK_FAMILIES:
    return "check"
  raise ValueError(f"family {family!r} is in neither FIT_FAMILIES nor CHECK_FAMILIES")


def _dense_weights(model: ModelConfig) -> list[tuple[str, int, int]]:
  """(role, K, N) of each weight every token passes through."""
  latent = model.latent_attention
  if latent:
    qk_head = latent.qk_nope_head_dim + latent.qk_rope_head_dim
    weights = [("q_proj", model.hidden, model.num_heads * qk_head),
               ("kv_a_proj", model.hidden, latent.kv_lora_rank + latent.qk_rope_head_dim),
               ("kv_b_proj", latent.kv_lora_rank,
                model.num_heads * (latent.qk_nope_head_dim + latent.v_head_dim)),
               ("o_proj", model.num_heads * latent.v_head_dim, model.hidden)]
  else:
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    weights = [("qkv", model.hidden, qkv), ("o_proj", model.q_width, model.hidden)]
  if model.intermediate is not None:
    weights += _mlp_weights("", model.hidden, model.intermediate, model.gated)
  return weights + [("lm_head", model.hidden, model.vocab)]


def _mlp_weights(prefix: str, hidden: int, intermediate: int,
                 gated: bool) -> list[tuple[str, int, int]]:
  up = ("gate_up", 2 * intermediate) if gated else ("up", intermediate)
  return [(prefix + up[0], hidden, up[1]), (prefix + "down", intermediate, hidden)]


def _forward(weights, tokens: int, step: str) -> Iterator[tuple]:
  for role, k, n in weights:
    yield tokens, k, n, NN, role, step


def _training(weights, tokens: int) -> Iterator[tuple]:
  """The forward, d input and d weight products of a training step."""
  yield from _forward(weights, tokens, TRAIN_FORWARD)
  for role, k, n in weights:
    yield tokens, n, k, NT, role, TRAIN_D_INPUT
    yield k, tokens, n, TN, role, TRAIN_D_WEIGHT


def _experts(model: ModelConfig, tokens: int, step: str) -> Iterator[tuple]:
  """The forward products of the routed experts (the busiest one, balanced and skewed)
  and of the shared ones."""
  moe = model.moe
  if moe is None:
    return
  for expert_tokens in moe.expert_tokens(tokens):
    yield from _forward(_mlp_weights("expert_", model.hidden, moe.expert_intermediate,
                                     model.gated), expert_tokens, step)
  if moe.shared_intermediate:
    yield from _forward(_mlp_weights("shared_expert_", model.hidden, moe.shared_intermediate,
                                     model.gated), tokens, step)


def _lora(model: ModelConfig, workload: Workload) -> Iterator[tuple]:
  out = model.q_width if workload.lora_target == "q" else model.intermediate
  for rank in workload.lora_ranks:
    yield from _training([("lora_a", model.hidden, rank), ("lora_b", rank, out)], TRAIN_TOKENS)


def model_gemms(model: ModelConfig, workload: Workload) -> Iterator[tuple]:
  """(m, k, n, layout, role, step) of every GEMM of `workload`'s steps of `model`."""
  dense = _dense_weights(model)
  if workload.train:
    yield from _training(dense, TRAIN_TOKENS)
    yield from _experts(model, TRAIN_TOKENS, TRAIN_FORWARD)
  if workload.prefill:
    yield from _forward(dense, PREFILL_TOKENS, PREFILL)
    yield from _experts(model, PREFILL_TOKENS, PREFILL)
  for batch in workload.decode_batches:
    yield from _forward(dense, batch, DECODE)
    yield from _experts(model, batch, DECODE)
  yield from _lora(model, workload)


@functools.cache
def _problems() -> tuple[Problem, ...]:
  merged = {}
  for model in MODELS:
    half = family_half(model.family)
    for m, k, n, layout, role, step in model_gemms(model, WORKLOADS[model.name]):
      entry = merged.setdefault((m, k, n, layout), dict(halves=set(), models=set(), roles=set(),
                                                        steps=set()))
      entry["halves"].add(half)
      entry["models"].add(model.name)
      entry["roles"].add(role)
      entry["steps"].add(step)
  order = [model.name for model in MODELS]
  problems = [
      Problem(m=m, k=k, n=n, layout=layout, half="fit" if "fit" in e["halves"] else "check",
              models=tuple(sorted(e["models"], key=order.index)), roles=tuple(sorted(e["roles"])),
              steps=tuple(sorted(e["steps"], key=STEPS.index)))
      for (m, k, n, layout), e in merged.items()]
  return tuple(sorted(problems, key=lambda p: (HALVES.index(p.half), p.m, p.k, p.n,
                                               p.layout.name)))


def suite(half: str | None = None) -> tuple[Problem, ...]:
  """The problems of one half ("fit" or "check") or of both (None), fit first, each
  half sorted by (m, k, n, layout)."""
  if half not in (None, *HALVES):
    raise ValueError(f"half must be one of {HALVES} or None, got {half!r}")
  return tuple(p for p in _problems() if half in (None, p.half))
