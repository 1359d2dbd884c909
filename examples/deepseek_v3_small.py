"""A DeepSeek-V3-architecture model on FP8: quantize, save, reload, generate, compare with BF16.

The model is built from a scaled-down DeepSeek-V3 config (MLA attention with q/kv LoRA, MoE
with 64 routed experts + a shared expert, the first layer dense) with random weights, which is
enough to measure memory and speed:

    python examples/deepseek_v3_small.py                   # GPU: hidden 2048, 64 experts, 6 layers (~6 GB BF16)
    python examples/deepseek_v3_small.py --preset v3 --compile   # DeepSeek-V3's own layer widths, 4 layers (~12 GB)
    python examples/deepseek_v3_small.py --layers 12 --compile
    python examples/deepseek_v3_small.py --preset tiny     # CPU-sized (the default without a GPU)
    python examples/deepseek_v3_small.py --preset v3 --no-fuse-norms   # transformers' own RMSNorm in the FP8 model

Steps: BF16 logits -> quantize_model_ on a copy -> save_pretrained -> from_pretrained (FP8 straight
from disk) -> logits vs BF16, then BF16 and FP8 timed side by side (alternating calls, so drifts
of the machine hit both) -> greedy-token agreement; on a GPU also the experts module alone, BF16
vs FP8, at batch sizes 1..64.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, DeepseekV3Config

from fp8linear.tools.evaluation import weight_bytes
from fp8linear.integrations.experts import Fp8Experts
from fp8linear.integrations.transformers import from_pretrained, quantize_model_, save_pretrained

PRESETS = {
    # DeepSeek-V2-Lite-like widths: hidden 2048, 64 experts x 1408, top-6, MLA with q_lora.
    "small": dict(hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408, n_routed_experts=64,
                  num_experts_per_tok=6, n_shared_experts=2, n_group=8, topk_group=4, num_attention_heads=16,
                  q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    # DeepSeek-V3's own layer widths (hidden 7168, MLA with 128 heads, experts of 2048, top-8),
    # with 32 routed experts instead of 256 so that BF16 and FP8 copies fit one GPU side by side.
    "v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=32,
               num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=128,
               q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    # CPU-sized, with dims that are not multiples of 128.
    "tiny": dict(hidden_size=320, intermediate_size=896, moe_intermediate_size=192, n_routed_experts=16,
                 num_experts_per_tok=4, n_shared_experts=1, n_group=4, topk_group=2, num_attention_heads=4,
                 q_lora_rank=192, kv_lora_rank=128, qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64),
}


def make_config(preset: str, layers: int) -> DeepseekV3Config:
    p = PRESETS[preset]
    return DeepseekV3Config(
        vocab_size=32000, num_hidden_layers=layers, first_k_dense_replace=1, num_key_value_heads=p["num_attention_heads"],
        max_position_embeddings=8192, tie_word_embeddings=False, **p,
    )


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def timed_generation_pair(models: dict, prompt: torch.Tensor, new_tokens: int, repeats: int = 5) -> dict:
    """Per model: (prefill tokens/s, decode tokens/s, generated ids, decode tokens/s by the whole-run
    measure) for greedy generation at this batch; `new_tokens` >= 2.

    The models are timed side by side: each round calls every model once, first one model first,
    then the other, so slow phases of the machine (this example's eager runs are bound by the host
    CPU, whose speed was seen to drift by 30% between runs) and whatever the first caller of a
    shape pays hit all of them. Medians of `repeats` rounds after a warm-up.
    Prefill = generate(max_new_tokens=1). Decode = the median interval between consecutive
    generated tokens inside the full generations (a stopping criterion synchronises and stamps each
    step; generate() synchronises at every step anyway, to check for finished sequences): the
    steady-state time per output token. Also (full generation - prefill) / (new_tokens - 1), which
    carries the prefill's GPU tail and each run's setup, and so drifts with the host.
    """
    from transformers import StoppingCriteria, StoppingCriteriaList

    class StepStamps(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            sync(dev)
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kw = dict(do_sample=False, pad_token_id=0, min_new_tokens=new_tokens)
    dev = prompt.device
    for model in models.values():
        model.generate(prompt, max_new_tokens=new_tokens, **kw)  # warm-up (and compilation)
        model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)

    def timed(fn) -> float:
        sync(dev)
        t0 = time.perf_counter()
        fn()
        sync(dev)
        return time.perf_counter() - t0

    pre = {name: [] for name in models}
    full = {name: [] for name in models}
    steps = {name: [] for name in models}
    outs = {}
    for r in range(repeats):
        order = list(models.items())[::(-1) ** r]  # which model goes first alternates round by round
        for name, model in order:
            pre[name].append(timed(lambda: model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)))
        for name, model in order:
            stamps = StepStamps()
            full[name].append(timed(lambda: outs.__setitem__(name, model.generate(
                prompt, max_new_tokens=new_tokens, stopping_criteria=StoppingCriteriaList([stamps]), **kw))))
            steps[name] += [b - a for a, b in zip(stamps.times, stamps.times[1:])]
    result = {}
    for name in models:
        p, f = statistics.median(pre[name]), statistics.median(full[name])
        result[name] = (prompt.numel() / p, prompt.shape[0] / statistics.median(steps[name]),
                        outs[name][:, prompt.shape[1]:], prompt.shape[0] * (new_tokens - 1) / max(f - p, 1e-9))
    return result


@torch.no_grad()
def experts_bench(bf16_experts: torch.nn.Module, fp8_experts: torch.nn.Module, top_k: int, hidden: int) -> None:
    """The routed experts alone, BF16 vs FP8, at batch sizes (tokens) 1..64."""
    print(f"\nexperts module alone ({fp8_experts.num_experts} experts, top-{top_k}):")
    print(f"{'tokens':>8}{'BF16 us':>10}{'FP8 us':>10}{'speedup':>9}")
    for t in (1, 2, 4, 8, 16, 32, 64):
        x = torch.randn(t, hidden, device="cuda", dtype=torch.bfloat16)
        idx = torch.stack([torch.randperm(fp8_experts.num_experts, device="cuda")[:top_k] for _ in range(t)])
        w = torch.rand(t, top_k, device="cuda", dtype=torch.bfloat16)
        times = []
        for mod in (bf16_experts, fp8_experts):
            for _ in range(3):
                mod(x, idx, w)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                mod(x, idx, w)
            g.replay()
            torch.cuda.synchronize()
            reps = 50
            t0 = time.perf_counter()
            for _ in range(reps):
                g.replay()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) / reps * 1e6)
        print(f"{t:8d}{times[0]:10.1f}{times[1]:10.1f}{times[0] / times[1]:9.2f}x")


@torch.no_grad()
def profile_forward(model, prompt: torch.Tensor, label: str, out_dir: str | None, rows: int = 18) -> None:
    """Kernel time table (torch.profiler) of one prefill forward and of 8 decode steps after it."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if prompt.device.type == "cuda" else [])
    sort = "cuda_time_total" if prompt.device.type == "cuda" else "cpu_time_total"
    for _ in range(2):  # warm-up (Triton compilation, autotune caches)
        out = model(prompt, use_cache=True)
        cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        for _ in range(8):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
    sync(prompt.device)
    for phase, fn in (("prefill", lambda: model(prompt, use_cache=True)),
                      ("generate-1", lambda: model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0))):
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            sync(prompt.device)
            times.append(time.perf_counter() - t0)
        print(f"{label} {phase}: {statistics.median(times) * 1e3:.2f} ms (wall, median of 3)")
    import cProfile
    import io
    import pstats

    for phase, fn in (("generate-1", lambda: model.generate(prompt, max_new_tokens=1, do_sample=False, pad_token_id=0)),
                      ("decode-step", lambda: model(tok, past_key_values=cache, use_cache=True))):
        pr = cProfile.Profile()
        pr.enable()
        fn()
        sync(prompt.device)
        pr.disable()
        buf = io.StringIO()
        pstats.Stats(pr, stream=buf).sort_stats("tottime").print_stats(rows)
        print(f"\n--- cProfile: {label} {phase} ---\n" + "\n".join(buf.getvalue().splitlines()[:rows + 12]))
    for phase in ("prefill", "decode"):
        with profile(activities=acts) as prof:
            if phase == "prefill":
                out = model(prompt, use_cache=True)
                cache, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
            else:
                for _ in range(8):
                    tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1:].argmax(-1)
            sync(prompt.device)
        table = prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=60)
        print(f"\n--- profile: {label} {phase} ---\n{table}")
        if out_dir:
            import pathlib

            pathlib.Path(out_dir).mkdir(parents=True, exist_ok=True)
            full = prof.key_averages().table(sort_by=sort, row_limit=200, max_name_column_width=100)
            (pathlib.Path(out_dir) / f"{label}_{phase}.txt").write_text(full)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=tuple(PRESETS), default="small" if torch.cuda.is_available() else "tiny")
    ap.add_argument("--layers", type=int, default=None, help="default: 6 (small), 4 (v3), 3 (tiny)")
    ap.add_argument("--granularity", default="block", choices=("block", "row", "tensor"))
    ap.add_argument("--prefill", type=int, default=None, help="prompt tokens; default 2048 on a GPU, 32 on the CPU")
    ap.add_argument("--new-tokens", type=int, default=None, help="default 64 on a GPU, 8 on the CPU")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--compile", action="store_true", help="static KV cache: generate() compiles the forward (torch.compile, CUDA graphs)")
    ap.add_argument("--no-fuse-norms", action="store_true",
                    help="keep transformers' RMSNorm modules in the FP8 model (default: one-launch FusedRMSNorm)")
    ap.add_argument("--profile", nargs="?", const="", default=None, metavar="DIR",
                    help="also print torch.profiler kernel tables (one prefill, 8 decode steps) per model; save them in DIR")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    layers = args.layers or {"small": 6, "v3": 4}.get(args.preset, 3)
    prefill = args.prefill or (2048 if on_gpu else 32)
    new_tokens = args.new_tokens or (64 if on_gpu else 8)
    if new_tokens < 2:
        raise ValueError(f"--new-tokens must be at least 2 (decode speed is timed between tokens), got {new_tokens}")

    config = make_config(args.preset, layers)
    torch.manual_seed(0)
    with device:
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    if args.compile:  # with a static cache on a GPU, generate() compiles the forward itself (CUDA graphs)
        model.generation_config.cache_implementation = "static"
    print(f"DeepSeek-V3 architecture, preset {args.preset}: {layers} layers, hidden {config.hidden_size}, "
          f"{config.n_routed_experts} experts (top-{config.num_experts_per_tok}) + {config.n_shared_experts} shared, "
          f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, on {device}")
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (1, prefill), generator=gen).to(device)
    probe = torch.randint(0, config.vocab_size, (2, 64), generator=gen).to(device)

    bf16_bytes = weight_bytes(model)
    with torch.no_grad():
        ref_logits = model(probe).logits.float()
    if args.profile is not None:
        profile_forward(model, prompt, "bf16", args.profile or None)
    bf16_experts = model.model.layers[1].mlp.experts if on_gpu else None

    to_quantize = copy.deepcopy(model)  # the BF16 model stays, to be timed side by side
    report = quantize_model_(to_quantize, granularity=args.granularity, fuse_norms=not args.no_fuse_norms)
    print(report)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        save_pretrained(to_quantize, tmp)
        saved = time.perf_counter() - t0
        del to_quantize
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            held = torch.cuda.memory_allocated()  # the BF16 model, kept for the side-by-side timings
        t0 = time.perf_counter()
        fp8 = from_pretrained(tmp, device_map=str(device), fuse_norms=not args.no_fuse_norms)
        loaded = time.perf_counter() - t0
    peak = (f", peak GPU memory added while loading {(torch.cuda.max_memory_allocated() - held) / 2**30:.2f} GiB"
            if on_gpu else "")
    print(f"saved in {saved:.1f} s, reloaded with from_pretrained in {loaded:.1f} s{peak}")
    if args.compile:  # with a static cache on a GPU, generate() compiles the forward itself (CUDA graphs)
        fp8.generation_config.cache_implementation = "static"
    fp8_bytes = weight_bytes(fp8)
    with torch.no_grad():
        out_logits = fp8(probe).logits.float()
    timings = timed_generation_pair({"bf16": model, "fp8": fp8}, prompt, new_tokens)
    (bf16_pre, bf16_dec, bf16_ids, bf16_diff), (fp8_pre, fp8_dec, fp8_ids, fp8_diff) = timings["bf16"], timings["fp8"]
    if args.profile is not None:
        profile_forward(fp8, prompt, "fp8", args.profile or None)

    rel = ((out_logits - ref_logits).norm() / ref_logits.norm()).item()
    top1 = (out_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean().item()
    same = (fp8_ids == bf16_ids).float().mean().item()
    gib = 2**30
    print(f"\n{'':24}{'BF16':>12}{'FP8':>12}{'FP8/BF16':>10}")
    print(f"{'weight memory (GiB)':24}{bf16_bytes / gib:12.3f}{fp8_bytes / gib:12.3f}{fp8_bytes / bf16_bytes:10.3f}")
    print(f"{f'prefill tok/s ({prefill})':24}{bf16_pre:12.1f}{fp8_pre:12.1f}{fp8_pre / bf16_pre:10.2f}")
    print(f"{'decode tok/s (batch 1)':24}{bf16_dec:12.1f}{fp8_dec:12.1f}{fp8_dec / bf16_dec:10.2f}")
    print(f"{'  (full-prefill)/(n-1)':24}{bf16_diff:12.1f}{fp8_diff:12.1f}{fp8_diff / bf16_diff:10.2f}")
    print(f"logits vs BF16 (random weights): relative L2 error {rel:.3f}, top-1 agreement {top1 * 100:.1f}%; "
          f"generated tokens identical to BF16: {same * 100:.1f}%")
    if on_gpu:
        experts_bench(bf16_experts, fp8.model.layers[1].mlp.experts, config.num_experts_per_tok, config.hidden_size)
    assert isinstance(fp8.model.layers[1].mlp.experts, Fp8Experts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
