"""The model-shape suite: its split, its GEMMs and what `bench_matmul --suite=models` times."""

import collections
from unittest import mock

from absl.testing import absltest, parameterized

from pipelines.operands import NN
from tools import bench_matmul, model_shapes
from tools.model_shapes import NT, TN

MODELS = {model.name: model for model in model_shapes.MODELS}
# Each half may cost at most this many problems (each takes seconds per dtype).
MAX_PROBLEMS_PER_HALF = 80


def find(half, m, k, n, layout):
  """The problem of `half` with these sizes and layout, or None."""
  return next((p for p in model_shapes.suite(half)
               if (p.m, p.k, p.n, p.layout) == (m, k, n, layout)), None)


class SplitTest(absltest.TestCase):

  def test_at_least_ten_families_and_twelve_models(self):
    self.assertGreaterEqual(len({model.family for model in model_shapes.MODELS}), 10)
    self.assertGreaterEqual(len(model_shapes.MODELS), 12)
    self.assertLen(MODELS, len(model_shapes.MODELS), "model names repeat")

  def test_every_family_is_in_exactly_one_half(self):
    fit, check = set(model_shapes.FIT_FAMILIES), set(model_shapes.CHECK_FAMILIES)
    self.assertTrue(fit and check)
    self.assertEmpty(fit & check)
    self.assertEqual(fit | check, {model.family for model in model_shapes.MODELS})

  def test_every_model_has_a_workload_that_gives_problems(self):
    self.assertEqual(set(model_shapes.WORKLOADS), set(MODELS))
    in_suite = {name for p in model_shapes.suite() for name in p.models}
    self.assertEqual(in_suite, set(MODELS))

  def test_family_half_rejects_an_unknown_family(self):
    with self.assertRaisesRegex(ValueError, "neither"):
      model_shapes.family_half("GPT-2")


class HalvesTest(parameterized.TestCase):

  @parameterized.parameters(*model_shapes.HALVES)
  def test_a_half_is_its_problems_only(self, half):
    problems = model_shapes.suite(half)
    self.assertNotEmpty(problems)
    self.assertLessEqual(len(problems), MAX_PROBLEMS_PER_HALF)
    self.assertEqual({p.half for p in problems}, {half})

  def test_halves_are_disjoint_and_make_the_whole_suite(self):
    fit, check = model_shapes.suite("fit"), model_shapes.suite("check")
    self.assertEqual(model_shapes.suite(), fit + check)
    key = lambda p: (p.m, p.k, p.n, p.layout)  # noqa: E731
    self.assertEmpty({key(p) for p in fit} & {key(p) for p in check})
    self.assertLen({key(p) for p in model_shapes.suite()}, len(model_shapes.suite()))

  def test_a_check_problem_comes_from_check_models_only(self):
    for p in model_shapes.suite("check"):
      for name in p.models:
        self.assertEqual(model_shapes.family_half(MODELS[name].family), "check", p)

  def test_suite_rejects_an_unknown_half(self):
    with self.assertRaisesRegex(ValueError, "half"):
      model_shapes.suite("both")

  def test_problems_are_sorted_and_positive(self):
    for half in model_shapes.HALVES:
      problems = model_shapes.suite(half)
      keys = [(p.m, p.k, p.n, p.layout.name) for p in problems]
      self.assertEqual(keys, sorted(keys))
      for p in problems:
        self.assertGreater(min(p.m, p.k, p.n), 0, p)
        self.assertIn(p.layout.name, ("NN", "NT", "TN"), p)
        self.assertTrue(p.models and p.roles and p.steps, p)
        self.assertContainsSubset(p.steps, model_shapes.STEPS)

  @parameterized.parameters(*model_shapes.HALVES)
  def test_each_half_has_every_kind_of_problem(self, half):
    problems = model_shapes.suite(half)
    roles = {role for p in problems for role in p.roles}
    steps = {step for p in problems for step in p.steps}
    self.assertContainsSubset({"lm_head", "expert_gate_up", "expert_down", "lora_a", "lora_b",
                               "o_proj", "down"}, roles)
    self.assertContainsSubset(set(model_shapes.STEPS), steps)
    self.assertContainsSubset({1, 16, 64, 256},
                              {p.m for p in problems if model_shapes.DECODE in p.steps})
    models = {MODELS[name] for p in problems for name in p.models}
    self.assertTrue(any(model.moe for model in models), "no MoE model")
    dense_hidden = sorted(model.hidden for model in models if model.moe is None)
    self.assertLessEqual(dense_hidden[0], 2304, "no small dense model")
    self.assertGreaterEqual(dense_hidden[-1], 4608, "no large dense model")
    decode_batches = {b for model in models
                      for b in model_shapes.WORKLOADS[model.name].decode_batches}
    self.assertEqual(decode_batches, {1, 16, 64, 256})
    lora_ranks = {r for model in models for r in model_shapes.WORKLOADS[model.name].lora_ranks}
    self.assertNotEmpty(lora_ranks)

  def test_the_halves_lora_ranks_cover_8_to_64(self):
    ranks = collections.Counter(r for workload in model_shapes.WORKLOADS.values()
                                for r in workload.lora_ranks)
    self.assertEqual(set(ranks), {8, 16, 32, 64})


class GemmsTest(absltest.TestCase):

  def test_llama_3_8b_training_step(self):
    tokens = model_shapes.TRAIN_TOKENS
    self.assertEqual(tokens, 4096)
    gate_up = find("fit", tokens, 4096, 2 * 14336, NN)
    self.assertIn("Llama-3-8B", gate_up.models)
    self.assertIn("gate_up", gate_up.roles)
    self.assertIn(model_shapes.TRAIN_FORWARD, gate_up.steps)
    # d input reads W (K, N) as stored: m=T, k=N, n=K; d weight reads x (T, K) as stored.
    self.assertIn(model_shapes.TRAIN_D_INPUT, find("fit", tokens, 2 * 14336, 4096, NT).steps)
    self.assertIn(model_shapes.TRAIN_D_WEIGHT, find("fit", 4096, tokens, 2 * 14336, TN).steps)
    qkv = find("fit", tokens, 4096, (32 + 2 * 8) * 128, NN)
    self.assertEqual(qkv.roles, ("qkv",))
    lm_head = find("fit", tokens, 4096, 128256, NN)
    self.assertEqual(lm_head.roles, ("lm_head",))
    self.assertEqual(MODELS["Llama-3-8B"].vocab, 128256)

  def test_lora_adapters(self):
    # Rank 8 on Llama 3 8B's q projection (4096 -> 4096) at the training tokens.
    tokens = model_shapes.TRAIN_TOKENS
    self.assertIn("lora_a", find("fit", tokens, 4096, 8, NN).roles)
    self.assertIn("lora_b", find("fit", tokens, 8, 4096, NN).roles)
    self.assertIn("lora_b", find("fit", 8, tokens, 4096, TN).roles)

  def test_experts_at_a_routers_token_counts(self):
    # Mixtral at a prefill: 2 of 8 experts, balanced 2048 * 2 / 8 = 512 tokens, skewed 4x.
    moe = MODELS["Mixtral-8x7B"].moe
    self.assertEqual(moe.expert_tokens(2048), (512, 2048))
    self.assertEqual(moe.expert_tokens(1), (1,))
    expert = find("fit", 512, 4096, 2 * 14336, NN)
    self.assertEqual(expert.models, ("Mixtral-8x7B",))
    self.assertEqual(expert.roles, ("expert_gate_up",))
    # Qwen1.5-MoE's routed experts (1408) and its shared expert (5632) at 4096 tokens.
    qwen = MODELS["Qwen1.5-MoE-A2.7B"].moe
    balanced, skewed = qwen.expert_tokens(4096)
    self.assertEqual((balanced, skewed), (274, 1096))
    self.assertIn("expert_down", find("fit", balanced, 1408, 2048, NN).roles)
    self.assertIn("shared_expert_gate_up", find("fit", 4096, 2048, 2 * 5632, NN).roles)

  def test_latent_attention(self):
    # DeepSeek-V2-Lite's projections at a prefill: q 2048 -> 16 * 192, kv_a -> 512 + 64,
    # kv_b 512 -> 16 * 256, o 16 * 128 -> 2048.
    tokens = model_shapes.PREFILL_TOKENS
    for k, n, role in ((2048, 3072, "q_proj"), (2048, 576, "kv_a_proj"),
                       (512, 4096, "kv_b_proj"), (2048, 2048, "o_proj")):
      problem = find("check", tokens, k, n, NN)
      self.assertIn(role, problem.roles)
      self.assertIn("DeepSeek-V2-Lite", problem.models)

  def test_a_merged_problem_keeps_every_model(self):
    # Mistral 7B decodes Mixtral's attention, LM head and (skewed) expert shapes.
    lm_head = find("fit", 64, 4096, 32000, NN)
    self.assertEqual(lm_head.models, ("Mistral-7B", "Mixtral-8x7B"))
    mlp = find("fit", 64, 4096, 2 * 14336, NN)
    self.assertEqual(mlp.models, ("Mistral-7B", "Mixtral-8x7B"))
    self.assertEqual(mlp.roles, ("expert_gate_up", "gate_up"))
    self.assertEqual(mlp.steps, (model_shapes.DECODE,))

  def test_a_problem_of_both_halves_is_a_fit_problem(self):
    fit_model, check_model = MODELS["Llama-3-8B"], MODELS["OLMo-2-7B"]
    workloads = {"Llama-3-8B": model_shapes.Workload(decode_batches=(16,)),
                 "OLMo-2-7B": model_shapes.Workload(decode_batches=(16,))}
    with mock.patch.multiple(model_shapes, MODELS=(fit_model, check_model),
                                      WORKLOADS=workloads):
      model_shapes._problems.cache_clear()
      try:
        o_proj = find(None, 16, 4096, 4096, NN)
      finally:
        model_shapes._problems.cache_clear()
    self.assertEqual(o_proj.half, "fit")
    self.assertEqual(o_proj.models, ("Llama-3-8B", "OLMo-2-7B"))

  def test_configs_are_validated(self):
    with self.assertRaisesRegex(ValueError, "positive"):
      model_shapes.ModelConfig(name="x", family="x", hidden=0, intermediate=8, num_heads=1,
                               num_kv_heads=1, head_dim=8, vocab=8)
    with self.assertRaisesRegex(ValueError, "lora_target"):
      model_shapes.Workload(lora_target="k")


class BenchMatmulTest(absltest.TestCase):

  def test_the_check_half_times_check_problems_only(self):
    problems = bench_matmul.problem_list("models", [NN], half="check")
    self.assertLen(problems, len(model_shapes.suite("check")))
    for (m, k, n), layouts, tags in problems:
      self.assertEqual(tags["half"], "check")
      (layout,) = layouts
      problem = find("check", m, k, n, layout)
      self.assertIsNotNone(problem)
      self.assertEqual(tags["models"], list(problem.models))
      self.assertEqual(set(tags), {"half", "models", "roles", "steps"})

  def test_both_halves_and_the_other_suites(self):
    self.assertLen(bench_matmul.problem_list("models", [NN]), len(model_shapes.suite()))
    layouts = [NN, TN]
    self.assertEqual(bench_matmul.problem_list("narrow", layouts),
                     [(shape, layouts, {}) for shape in bench_matmul.NARROW_OUTPUTS])
    self.assertEqual(bench_matmul.problem_list("models", layouts, shapes=[(8, 16, 32)]),
                     [((8, 16, 32), layouts, {})])

  def test_a_stopped_run_is_finished_without_its_timed_problems(self):
    """--skip_done: what an earlier run timed jnp.dot on, in its dtype and
    layout, is not timed again; a problem whose jnp.dot failed is."""
    def record(kernel, shape, dtype="bfloat16", layout="NN", **rest):
      return dict(kernel=kernel, shape=shape, dtype=dtype, layout=layout, **rest)

    earlier = [record("jnp.dot", "16x4096x4096", median_us=7.7),
               record("ours: warp-specialized", "16x4096x4096", median_us=9.5),
               record("jnp.dot", "64x4096x18944", layout="TN", median_us=47.8),
               record("jnp.dot", "1x2x3", error="RuntimeError")]
    self.assertEqual(bench_matmul.done_problems(earlier),
                     {("16x4096x4096", "bfloat16", "NN"), ("64x4096x18944", "bfloat16", "TN")})

  def test_summary_per_half(self):
    def record(kernel, shape, ratio, half):
      return dict(kernel=kernel, shape=shape, dtype="float16", layout="NN", ratio_to_dot=ratio,
                  half=half)

    ws, heuristic = bench_matmul.WARP_SPECIALIZED, bench_matmul.HEURISTIC
    records = [record(ws, "1x2x3", 1.2, "check"), record(heuristic, "1x2x3", 0.9, "check"),
               record(ws, "4x5x6", 0.8, "check"), record(ws, "7x8x9", 1.0, "fit")]
    lines = bench_matmul.ratio_summary(records)
    self.assertIn(f"median ratio to jnp.dot, check half, {ws}: 1.000 (1 of 2 below 0.95x)",
                  lines)
    self.assertIn(f"median ratio to jnp.dot, check half, {bench_matmul.HEURISTIC_ALONE}: "
                  "0.850 (2 of 2 below 0.95x)", lines)
    self.assertIn(f"median ratio to jnp.dot, fit half, {ws}: 1.000 (0 of 1 below 0.95x)", lines)
    plain = [dict(kernel=ws, shape="1x2x3", dtype="float16", layout="NN", ratio_to_dot=1.1)]
    self.assertEqual(bench_matmul.ratio_summary(plain), [f"median ratio to jnp.dot, {ws}: 1.100"])


if __name__ == "__main__":
  absltest.main()
