"""Time Fp8Experts against the BF16 transformers experts module on this GPU (DeepSeek-V3-like dims).

    PYTHONPATH=. python benchmarks/bench_moe.py                       # batch 1..64 and 2048, CSV to bench_moe.csv
    PYTHONPATH=. python benchmarks/bench_moe.py --inter 768 --csv out/moe_768.csv
    PYTHONPATH=. python benchmarks/bench_moe.py --sweep               # also time grouped-GEMM tile configs

The BF16 side is transformers' own ``DeepseekV3Experts`` with each requested experts
implementation (``grouped_mm`` is transformers' default; ``eager`` loops over experts with a
host sync and is timed without CUDA graphs). Both sides are timed inside a CUDA graph by
default (decode-style: launch overhead removed, as with ``generate`` + static cache + graphs);
``--no-cuda-graph`` times eager launches. Routing is a softmax top-k of random logits.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

import torch

try:
    from fp8linear.integrations.experts import Fp8Experts
except ImportError as e:  # not installed and not run with the repo root on the path
    sys.exit(f"cannot import fp8linear ({e}); run `pip install -e .` or `PYTHONPATH=. python benchmarks/bench_moe.py`")

DEFAULT_TOKENS = "1,2,4,8,16,32,64,2048"


def build_experts(hidden: int, inter: int, experts: int, top_k: int, impl: str) -> torch.nn.Module:
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Experts

    cfg = DeepseekV3Config(
        hidden_size=hidden, moe_intermediate_size=inter, n_routed_experts=experts, num_experts_per_tok=top_k,
        n_group=1, topk_group=1,
    )
    cfg._experts_implementation = impl
    with torch.device("cuda"):
        ex = DeepseekV3Experts(cfg).to(torch.bfloat16)
    with torch.no_grad():
        ex.gate_up_proj.normal_(0, 0.02)  # DeepSeek-V3 initializer_range
        ex.down_proj.normal_(0, 0.02)
    return ex.eval()


def routing(t: int, hidden: int, experts: int, top_k: int, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(t, hidden, device="cuda", generator=g).to(torch.bfloat16)
    w, idx = torch.topk(torch.randn(t, experts, device="cuda", generator=g).softmax(-1), top_k, dim=-1)
    return x, idx, w


def time_us(fn, iters: int, cuda_graph: bool) -> tuple[float, bool]:
    """Mean microseconds per call; returns (us, whether a CUDA graph was used)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm-up: Triton compilation, allocator, cuBLAS handles
            fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graphed = False
    if cuda_graph:
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                fn()
            run, graphed = graph.replay, True
        except RuntimeError:  # not capturable (e.g. eager experts call nonzero): time eagerly
            torch.cuda.synchronize()
            run = fn
    else:
        run = fn
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters, graphed


def sweep_configs(fp8: Fp8Experts, tokens: list[int], hidden: int, experts: int, top_k: int, iters: int) -> list[dict]:
    """Time the grouped GEMM alone (gate_up and down shapes) for a set of tile configs."""
    from fp8linear import quantize_activation
    from fp8linear.ops.configs import GemmConfig
    from fp8linear.ops.grouped_gemm import grouped_fp8_gemm, moe_align_block_size
    from fp8linear.ops.router import grouped_config

    candidates = [
        (16, 64, 4, 4), (16, 128, 4, 4), (16, 64, 4, 6), (32, 64, 4, 4), (32, 128, 4, 4),
        (64, 64, 4, 4), (64, 128, 4, 4), (64, 128, 4, 3), (128, 128, 8, 3), (128, 128, 8, 4), (128, 256, 8, 3),
    ]
    rows = []
    for t in tokens:
        x, idx, _ = routing(t, hidden, experts, top_k)
        x_q, x_s = quantize_activation(x)
        h_q, h_s = quantize_activation(torch.randn(t * top_k, fp8.intermediate_dim, device="cuda"))
        for proj, a_q, a_s, w, s, div in (
            ("gate_up", x_q, x_s, fp8.gate_up_proj, fp8.gate_up_proj_scale_inv, top_k),
            ("down", h_q, h_s, fp8.down_proj, fp8.down_proj_scale_inv, 1),
        ):
            default = grouped_config(t * top_k, experts, w.shape[1], w.shape[2])
            results = []
            for bm, bn, warps, stages in candidates:
                cfg = GemmConfig(block_m=bm, block_n=bn, block_k=128, group_m=1 if bm <= 32 else 8,
                                 num_warps=warps, num_stages=stages)
                r = moe_align_block_size(idx, experts, bm)
                fn = lambda: grouped_fp8_gemm(  # noqa: E731
                    a_q, a_s, w, s, r.sorted_pair_ids, r.block_expert, t * top_k, div, fp8.granularity,
                    torch.bfloat16, config=cfg,
                )
                try:
                    us, _ = time_us(fn, iters, cuda_graph=True)
                except Exception as exc:  # noqa: BLE001 - a config that fails to compile is reported, not fatal
                    print(f"  T={t} {proj} {cfg}: failed ({type(exc).__name__}: {exc})")
                    continue
                is_default = (bm, bn, warps, stages) == (default.block_m, default.block_n, default.num_warps, default.num_stages)
                results.append((us, bm, bn, warps, stages, is_default))
                rows.append({"tokens": t, "proj": proj, "block_m": bm, "block_n": bn, "num_warps": warps,
                             "num_stages": stages, "us": round(us, 2), "default": is_default})
            results.sort()
            best = results[0]
            dflt = next((r for r in results if r[5]), None)
            print(f"  sweep T={t:5d} {proj:7s} best bm={best[1]} bn={best[2]} w={best[3]} s={best[4]} "
                  f"{best[0]:8.1f} us; default {dflt[0] if dflt else float('nan'):8.1f} us")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_moe.py", description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=1408, help="moe_intermediate_size (1408 or 768 are typical)")
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--tokens", default=DEFAULT_TOKENS, help=f"comma-separated batch sizes (default {DEFAULT_TOKENS})")
    ap.add_argument("--granularity", default="block", choices=["block", "row", "tensor"])
    ap.add_argument("--baselines", default="grouped_mm,batched_mm,eager",
                    help="transformers experts implementations to time in BF16 (first one is the reference)")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--no-cuda-graph", action="store_true", help="time eager launches instead of CUDA graph replays")
    ap.add_argument("--sweep", action="store_true", help="also time grouped-GEMM tile configs per batch size")
    ap.add_argument("--csv", default="bench_moe.csv", help="where to write the results")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_moe.py needs a CUDA/ROCm GPU", file=sys.stderr)
        return 2
    tokens = [int(t) for t in args.tokens.split(",") if t]
    impls = [b for b in args.baselines.split(",") if b]
    graph = not args.no_cuda_graph
    import transformers
    import triton

    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}  "
          f"transformers {transformers.__version__}")
    print(f"H={args.hidden} I={args.inter} E={args.experts} top_k={args.top_k} granularity={args.granularity} "
          f"cuda_graph={graph}")

    bf16 = {}
    for impl in impls:
        mod = build_experts(args.hidden, args.inter, args.experts, args.top_k, impl)
        x, idx, w = routing(4, args.hidden, args.experts, args.top_k)
        try:  # an implementation this transformers version lacks (or that fails here) is skipped
            with torch.no_grad():
                mod(x, idx, w)
        except Exception as exc:  # noqa: BLE001 - reported and skipped, the others still run
            print(f"skipping bf16 {impl}: {type(exc).__name__}: {exc}")
            continue
        bf16[impl] = mod
    if not bf16:
        print("no BF16 experts implementation ran", file=sys.stderr)
        return 1
    impls = list(bf16)
    first = bf16[impls[0]]
    for other in impls[1:]:  # share the weights: same numbers, one copy in memory
        bf16[other].gate_up_proj, bf16[other].down_proj = first.gate_up_proj, first.down_proj
    fp8 = Fp8Experts.from_experts(first, granularity=args.granularity)
    bytes_bf16 = sum(p.numel() * p.element_size() for p in first.parameters())
    bytes_fp8 = sum(p.numel() * p.element_size() for p in fp8.parameters())
    print(f"expert weights: bf16 {bytes_bf16 / 2**20:.1f} MiB, fp8 {bytes_fp8 / 2**20:.1f} MiB "
          f"({bytes_fp8 / bytes_bf16:.3f}x)")

    rows = []
    header = f"{'tokens':>6} " + " ".join(f"{'bf16 ' + i:>16}" for i in impls) + f" {'fp8':>10} {'speedup':>8} {'rel_err':>8}"
    print(header)
    for t in tokens:
        x, idx, w = routing(t, args.hidden, args.experts, args.top_k)
        with torch.no_grad():
            ref = first(x, idx, w)
            err = ((fp8(x, idx, w).float() - ref.float()).norm() / ref.float().norm()).item()
            times = {}
            for impl, mod in bf16.items():
                # eager experts sync with the host (nonzero): never capture them in a graph
                times[impl], graphed = time_us(lambda mod=mod: mod(x, idx, w), args.iters, graph and impl != "eager")
                rows.append({"tokens": t, "impl": f"bf16_{impl}", "us": round(times[impl], 2), "cuda_graph": graphed})
            fp8_us, graphed = time_us(lambda: fp8(x, idx, w), args.iters, graph)
        rows.append({"tokens": t, "impl": f"fp8_{args.granularity}", "us": round(fp8_us, 2), "cuda_graph": graphed,
                     "speedup_vs_" + impls[0]: round(times[impls[0]] / fp8_us, 3), "rel_err": round(err, 4)})
        print(f"{t:>6} " + " ".join(f"{times[i]:>13.1f} us" for i in impls)
              + f" {fp8_us:>7.1f} us {times[impls[0]] / fp8_us:>7.2f}x {err:>8.4f}")

    if args.sweep:
        print("grouped GEMM tile sweep (CUDA graph replays):")
        sweep_rows = sweep_configs(fp8, tokens, args.hidden, args.experts, args.top_k, args.iters)
        sweep_path = Path(args.csv).with_name(Path(args.csv).stem + "_sweep.csv")
        _write_csv(sweep_path, sweep_rows)
        print(f"wrote {sweep_path}")

    _write_csv(Path(args.csv), rows)
    print(f"wrote {args.csv}")
    return 0


def _write_csv(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields: list[str] = []
    for r in rows:
        fields += [k for k in r if k not in fields]
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields)
        writer.writeheader()
        writer.writerows(rows)


if __name__ == "__main__":
    sys.exit(main())
