"""Where an eager decode step spends host time: BF16 against FP8, per submodule kind.

Builds the DeepSeek-V3-width model of `examples/deepseek_v3_small.py` (preset v3, random weights),
an FP8 copy (`quantize_model_`), prefills one prompt, then times eager decode steps of both models
(interleaved): wall time per step (synchronised), host time per step (enqueue only), and the host
time spent inside each kind of submodule (attention, router gate, routed experts, shared experts,
dense MLP, norms, lm_head), summed over a step, from forward hooks; decode time per token inside
`generate()` (and a cProfile of one generate per model). Ends with a cProfile of one FP8
step sorted by cumulative time. Every sequence length is run once before it is timed (its first
step pays for attention plans that are the same for both models).

    python benchmarks/decode_host_probe.py [--prefill 2048] [--steps 16]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from deepseek_v3_small import make_config  # noqa: E402

from fp8linear.integrations.transformers import quantize_model_  # noqa: E402

KINDS = ("self_attn", "gate", "experts", "shared_experts", "mlp", "input_layernorm", "post_attention_layernorm",
         "lm_head")


def kind_of(name: str) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if last == "mlp" and "layers.0." not in name:
        return None  # the MoE block: its parts are timed instead
    return last if last in KINDS else None


def attach_timers(model: torch.nn.Module, acc: dict) -> list:
    """Add each kind's host seconds per call to acc[kind] (forward hooks); returns the hooks' handles."""
    handles = []
    for name, mod in model.named_modules():
        kind = kind_of(name)
        if kind is None:
            continue

        def pre(m, args, _k=kind):
            m._probe_t0 = time.perf_counter()

        def post(m, args, out, _k=kind):
            acc[_k] += time.perf_counter() - m._probe_t0

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post))
    return handles


@torch.no_grad()  # as generate() runs: without autograd's bookkeeping on the BF16 layers
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--preset", default="v3", help="examples/deepseek_v3_small.py preset (tiny: a CPU check)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    with dev:
        bf16 = AutoModelForCausalLM.from_config(make_config(a.preset, 4), dtype=torch.bfloat16).eval()
    fp8 = copy.deepcopy(bf16)
    quantize_model_(fp8, granularity="block")
    models = {"bf16": bf16, "fp8": fp8}
    prompt = torch.randint(0, 32000, (1, a.prefill), device=dev)
    caches = {}

    def prefill_all():
        """Both models back at the prompt: later steps meet sequence lengths already run."""
        for name, m in models.items():
            out = m(prompt, use_cache=True)
            caches[name] = (out.past_key_values, out.logits[:, -1:].argmax(-1))
        sync()

    def step(name):
        cache, tok = caches[name]
        tok = models[name](tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        caches[name] = (cache, tok)

    # A sequence length's first step pays for its attention plan (H100, torch 2.11: cuDNN SDPA,
    # about 11 ms per layer), whichever model meets it first. Run every length of the timed steps
    # once first (and make the plans of the FP8 layers), then time both models over those lengths.
    prefill_all()
    for _ in range(a.steps + 4):
        for name in models:
            step(name)
    where = torch.cuda.get_device_name() if dev.type == "cuda" else "CPU"
    print(f"{where}, prefill {a.prefill}, {a.steps} decode steps each (ms, medians)")
    # second sight: each FP8 layer makes its plan for a shape met once before; planned: all planned
    for label in ("second sight", "planned"):
        prefill_all()
        walls, hosts = defaultdict(list), defaultdict(list)
        for i in range(a.steps):
            for name in list(models)[::(-1) ** i]:  # which model steps first alternates
                sync()
                t0 = time.perf_counter()
                step(name)
                t1 = time.perf_counter()
                sync()
                hosts[name].append((t1 - t0) * 1e3)
                walls[name].append((time.perf_counter() - t0) * 1e3)
        print(f" {label}:")
        for name in models:
            print(f"  {name}: wall {statistics.median(walls[name]):.2f} ms/step, "
                  f"host {statistics.median(hosts[name]):.2f}")
    # generate(): what transformers' loop adds around the same steps. Decode ms per token =
    # (generate of 1 + steps tokens - generate of 1 token) / steps, medians of interleaved rounds.
    kw = dict(do_sample=False, pad_token_id=0)
    gen = {(name, n): [] for name in models for n in (1, a.steps + 1)}
    for r in range(4):
        for name in list(models)[::(-1) ** r]:
            for n in (1, a.steps + 1):
                sync()
                t0 = time.perf_counter()
                models[name].generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
                sync()
                gen[(name, n)].append((time.perf_counter() - t0) * 1e3)
    print(" generate():")
    for name in models:
        g1, gn = (statistics.median(gen[(name, n)][1:]) for n in (1, a.steps + 1))
        print(f"  {name}: decode {(gn - g1) / a.steps:.2f} ms/token (generate of 1 token {g1:.2f} ms)")
    # Per-token intervals inside one generate (a stopping criterion synchronises and stamps each
    # step): the steady-state decode step, without the prefill's GPU tail in the difference above
    # (the first decode step is left out here; examples/deepseek_v3_small.py keeps it).
    from transformers import StoppingCriteria, StoppingCriteriaList

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores, **kwargs):
            sync()
            self.t.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    steps = {name: [] for name in models}
    for r in range(3):
        for name in list(models)[::(-1) ** r]:
            stamp = Stamp()
            models[name].generate(prompt, max_new_tokens=a.steps + 1, min_new_tokens=a.steps + 1,
                                  stopping_criteria=StoppingCriteriaList([stamp]), **kw)
            steps[name] += [(b - a_) * 1e3 for a_, b in zip(stamp.t[1:], stamp.t[2:])]
    for name in models:
        print(f"  {name}: step interval inside generate (synchronised) {statistics.median(steps[name]):.2f} ms")
    # FP8 layer calls that miss their plan (validation and routing on the call), per decode token
    from fp8linear.module import Fp8BlockLinear

    slow = defaultdict(int)
    unplanned = Fp8BlockLinear._forward_and_plan

    def counted(self, x):
        slow[(tuple(x.shape), x.is_contiguous(), x.data_ptr() % 16)] += 1
        return unplanned(self, x)

    Fp8BlockLinear._forward_and_plan = counted
    try:
        for label, fn in (("step loop", lambda: [step("fp8") for _ in range(a.steps)]),
                          ("generate", lambda: fp8.generate(prompt, max_new_tokens=a.steps + 1,
                                                            min_new_tokens=a.steps + 1, **kw))):
            prefill_all()
            slow.clear()
            fn()
            sync()
            top = sorted(slow.items(), key=lambda kv: -kv[1])[:6]
            print(f"  fp8 {label}: {sum(slow.values())} unplanned layer calls in {a.steps} steps; "
                  f"(shape, contiguous, address % 16): count {top}")
    finally:
        Fp8BlockLinear._forward_and_plan = unplanned
    for name in ("fp8", "bf16"):
        pr = cProfile.Profile()
        pr.enable()
        models[name].generate(prompt, max_new_tokens=a.steps + 1, min_new_tokens=a.steps + 1, **kw)
        sync()
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(25)
        print(f"\n--- cProfile, generate of {a.steps + 1} tokens, {name}, tottime ---")
        print("\n".join(line[:170] for line in buf.getvalue().splitlines()[:40]))
    accs = {name: defaultdict(float) for name in models}
    for name, m in models.items():
        attach_timers(m, accs[name])
    prefill_all()
    for name in models:
        accs[name].clear()
        for _ in range(a.steps):
            step(name)
            sync()  # each step starts on an idle GPU: host time, as in the timed passes
    print(f"{'host ms per step':28s}{'bf16':>9s}{'fp8':>9s}")
    for kind in KINDS:
        b, f = (accs[n][kind] / a.steps * 1e3 for n in ("bf16", "fp8"))
        print(f"{kind:28s}{b:9.3f}{f:9.3f}")
    prefill_all()
    for _ in range(a.steps - 1):  # the profiled step is at a length every FP8 layer has a plan for
        for name in models:
            step(name)
    sync()
    for name in ("fp8", "bf16"):
        pr = cProfile.Profile()
        pr.enable()
        step(name)
        sync()
        pr.disable()
        for order, rows in (("cumulative", 45), ("tottime", 30)):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats(order).print_stats(rows)
            print(f"\n--- cProfile, one planned {name} step, {order} ---")
            print("\n".join(line[:170] for line in buf.getvalue().splitlines()[:rows + 15]))


if __name__ == "__main__":
    main()
