"""Eager decode of three copies of one model side by side: BF16, FP8 quantized in place
(`quantize_model_`) and FP8 saved and reloaded (`save_pretrained` + `from_pretrained`, as
`examples/deepseek_v3_small.py` does), to tell whether the loaded model's host path differs from the
in-place one. Prints the example's decode and prefill measures for the three, then what differs
between the two FP8 models (hooks, attention and experts implementations, module types, parameter
dtypes and devices) and the host time per submodule kind of one decode step (decode_host_probe.attach_timers).

    python benchmarks/decode_models_ab.py [--preset v3] [--new-tokens 64] [--prefill 2048]
"""

from __future__ import annotations

import argparse
import copy
import gc
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from deepseek_v3_small import make_config, sync, timed_generation_pair  # noqa: E402

from decode_host_probe import attach_timers  # noqa: E402  (this folder, the script's own)

from fp8linear.integrations.transformers import from_pretrained, quantize_model_, save_pretrained  # noqa: E402


def describe(model: torch.nn.Module) -> dict:
    mods = list(model.modules())
    return {
        "forward hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in mods),
        "accelerate hooks": sum(hasattr(m, "_hf_hook") for m in mods),
        "attention": model.config._attn_implementation,
        "experts": getattr(model.config, "_experts_implementation", None),
        "module types": sorted({type(m).__name__ for m in mods}),
        "parameters": sorted({(str(p.dtype), str(p.device), p.requires_grad) for p in model.parameters()}),
        "buffers": sorted({(n.rsplit(".", 1)[-1], str(b.dtype), str(b.device)) for n, b in model.named_buffers()}),
        "training": model.training,
    }


def kind_host_ms(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> dict:
    """Host ms per decode step inside each submodule kind (forward hooks; a synchronised GPU per step)."""
    acc: dict = defaultdict(float)
    handles = attach_timers(model, acc)
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(2):  # plans for these lengths
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
        out = model(prompt, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        acc.clear()
        t_all = t_wall = 0.0
        for _ in range(steps):
            sync(prompt.device)
            t0 = time.perf_counter()
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            t_all += time.perf_counter() - t0
            sync(prompt.device)
            t_wall += time.perf_counter() - t0
        gpu = {}
        if prompt.device.type == "cuda":  # kernel time per step (torch.profiler), the step's GPU work
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(4):
                    tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
                sync(prompt.device)
            evs = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            gpu = {"GPU (kernels)": sum(e.device_time for e in evs) / 4 / 1e3, "kernels": len(evs) / 4}
            by: dict = defaultdict(float)
            for e in evs:
                by[e.name[:60]] += e.device_time / 4 / 1e3
            gpu["top kernels"] = sorted(by.items(), key=lambda kv: -kv[1])[:8]
    for h in handles:
        h.remove()
    return {"step (host)": t_all / steps * 1e3, "step (wall)": t_wall / steps * 1e3,
            **{k: v / steps * 1e3 for k, v in acc.items()}, **gpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="v3")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prefill", type=int, default=2048)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = p.parse_args()
    torch.manual_seed(0)
    dev = torch.device(a.device)
    with dev:
        bf16 = AutoModelForCausalLM.from_config(make_config(a.preset, a.layers), dtype=torch.bfloat16).eval()
    inplace = copy.deepcopy(bf16)
    quantize_model_(inplace, granularity="block")
    with tempfile.TemporaryDirectory() as tmp:
        save_pretrained(inplace, tmp)
        gc.collect()
        loaded = from_pretrained(tmp, device_map=str(dev))
    models = {"bf16": bf16, "fp8 in place": inplace, "fp8 loaded": loaded}
    prompt = torch.randint(0, 32000, (1, a.prefill), generator=torch.Generator().manual_seed(1)).to(dev)
    res = timed_generation_pair(models, prompt, a.new_tokens)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"{where}, preset {a.preset}, prefill {a.prefill}, {a.new_tokens} new tokens")
    print(f"{'':14}{'prefill tok/s':>14}{'decode tok/s':>14}{'x BF16':>8}{'whole-run':>11}")
    for name, (pre, dec, _ids, diff) in res.items():
        print(f"{name:14}{pre:14.1f}{dec:14.1f}{dec / res['bf16'][1]:8.3f}{diff:11.1f}")
    d1, d2 = describe(inplace), describe(loaded)
    for key in d1:
        print(f"{key}: {'same' if d1[key] == d2[key] else 'DIFFER'}: in place {d1[key]}"
              + ("" if d1[key] == d2[key] else f" / loaded {d2[key]}"))
    rows: dict = {name: defaultdict(float) for name in models}
    tops: dict = {}
    for order in (list(models), list(models)[::-1]):  # each model once first, once last
        for name in order:
            for k, v in kind_host_ms(models[name], prompt, 16).items():
                if k == "top kernels":
                    tops[name] = v
                else:
                    rows[name][k] += v / 2
    kinds = list(dict.fromkeys(k for r in rows.values() for k in r))
    print(f"{'host ms/step':26}" + "".join(f"{n:>14}" for n in rows))
    for k in kinds:
        print(f"{k:26}" + "".join(f"{rows[n].get(k, 0.0):14.3f}" for n in rows))
    for name, top in tops.items():
        print(f"{name}: top kernels, ms per step: " + "; ".join(f"{k} {v:.3f}" for k, v in top))


if __name__ == "__main__":
    main()
