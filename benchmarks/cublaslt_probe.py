"""Host cost of the cuBLAS route: cuBLASLt called directly (fp8linear.ops.cublaslt) against
torch._scaled_mm, both behind the same CublasLinear (act_quant into cuBLAS's layout, then the GEMM),
with BF16 nn.Linear in the same interleaved eager rounds; GPU time under CUDA graphs; and whether
the two give the same bits.

With ``--gemm``: the GEMM alone on quantized activations under CUDA graphs (the `fp8linear bench`
timer, operands rotated past L2, methods interleaved): BF16, per-tensor cuBLAS FP8, our router's
choice without cuBLAS, cuBLASLt with torch's workspace limit (torch._scaled_mm's algorithm, the
package's default), with a 32 MiB limit (the heuristic's first algorithm, what a routes-table entry
naming 32 MiB runs) and the fastest of the heuristic's first --algos algorithms at 32 MiB (with its
index).

    python benchmarks/cublaslt_probe.py [--m 64 128 512 2048]
    python benchmarks/cublaslt_probe.py --gemm [--m 77 128 256 512] [--algos 8]
    python benchmarks/cublaslt_probe.py --padded-grid [--m 4 77 128 512 2048]

With ``--padded-grid``: 128x128 weights whose K/128 is not a multiple of 4, on cuBLASLt with the
weight-scale grid's rows padded to a multiple of 4 (the layout cuBLAS's 2-D block scaling reads)
against the same weight expanded to 1x128 scales; relative error of each against the float64
reference, and GEMM time under CUDA graphs. Also M not a multiple of 4 on M rows (no padded copy
of x_q) with the activation scales' leading dimension padded to a multiple of 4.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch import nn

from fp8linear import quantize_weight
from fp8linear.ops.linear import CublasLinear
from fp8linear.tools.bench_eager import _gpu_us, interleaved_wall_us

SHAPES = ((2112, 7168), (24576, 1536), (7168, 2048), (1536, 7168), (32768, 512), (1536, 576))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--m", nargs="+", type=int, default=[64, 128, 512, 2048])
    p.add_argument("--gemm", action="store_true", help="GEMM alone under CUDA graphs, cuBLASLt workspace limits")
    p.add_argument("--algos", type=int, default=8, help="with --gemm: heuristic algorithms timed")
    p.add_argument("--shapes", nargs="+", default=None, help="with --gemm: NxK shapes (default: SHAPES)")
    p.add_argument("--borrow", action="store_true",
                   help="GEMM alone under CUDA graphs at Ms between the routes table's measured Ms: cuBLASLt's "
                        "heuristic at M, the algorithm of the table's M run at M, and M padded to the table's M")
    p.add_argument("--padded-grid", action="store_true",
                   help="128x128 weights with K/128 not a multiple of 4: padded scale grid against 1x128 expansion")
    args = p.parse_args()
    if args.padded_grid:
        return padded_grid_probe(args)
    if args.borrow:
        return borrow_probe(args)
    if args.gemm:
        return gemm_probe(args)
    dev = torch.device("cuda")
    print(f"{torch.cuda.get_device_name()}; eager wall us per call (GPU us under graphs)")
    print(f"{'shape':>12s} {'M':>5s} {'bf16':>14s} {'scaled_mm':>14s} {'direct':>14s} {'dir/mm':>7s} {'dir/bf16':>8s} same")
    for n, k in SHAPES:
        lin = nn.Linear(k, n, bias=False, device=dev, dtype=torch.bfloat16)
        w_q, w_s = quantize_weight(lin.weight.detach(), "block")
        direct = CublasLinear(w_q, w_s, "block", None, direct=True)
        via_torch = CublasLinear(w_q, w_s, "block", None, direct=False)
        if direct.lt is None:
            raise SystemExit("cuBLASLt could not be set up here (see the log)")
        for m in args.m:
            xs = [torch.randn(m, k, device=dev, dtype=torch.bfloat16)
                  for _ in range(max(2, min(16, (100 << 20) // (m * k * 2))))]
            methods = {"bf16": lin, "scaled_mm": via_torch, "direct": direct}
            with torch.inference_mode():
                same = torch.equal(direct(xs[0]).view(torch.int16), via_torch(xs[0]).view(torch.int16))
                wall = interleaved_wall_us(methods, xs)
                gpu = {name: _gpu_us(fn, xs) for name, fn in methods.items()}
            cell = lambda name: f"{wall[name]:6.1f} ({gpu[name] or float('nan'):5.1f})"  # noqa: E731
            print(f"{n:>5d}x{k:<6d} {m:5d} {cell('bf16'):>14s} {cell('scaled_mm'):>14s} {cell('direct'):>14s}"
                  f" {wall['direct'] / wall['scaled_mm']:7.3f} {wall['direct'] / wall['bf16']:8.3f} {same}")


def _lt_call(gemm, plan: tuple, rows: int, n: int, dev: torch.device):
    """A call of `gemm` (held weight) on `plan` for x_q, x_s of `rows` rows: y and the workspace allocated per call."""
    def run(a, sa):
        y = torch.empty((rows, n), dtype=torch.bfloat16, device=dev)
        ws = torch.empty(max(plan[3], 1), dtype=torch.uint8, device=dev)
        gemm.run(plan, a.data_ptr(), sa.data_ptr(), y.data_ptr(), ws.data_ptr())
        return y
    return run


def _shapes(args: argparse.Namespace, default: list) -> list[tuple[int, int]]:
    """The --shapes given (NxK), else `default`."""
    return [tuple(int(v) for v in s.split("x")) for s in args.shapes] if args.shapes else list(default)


def _block_weight(n: int, k: int, dev: torch.device):
    """A random BF16 weight (N, K) and its 128x128-block FP8 quantization."""
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    return (w, *quantize_weight(w, "block"))


def _graph_us(fns: dict, dev: torch.device) -> dict[str, float]:
    """µs per call of each (fn, args) under CUDA graphs, operands rotated past L2, methods interleaved."""
    from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

    rounds = {}
    with torch.inference_mode():
        for name, (fn, fargs) in fns.items():
            nbytes = sum(t.numel() * t.element_size() for t in fargs)
            rounds[name], _ = prepare_cuda(fn, rotation_sets(fargs, nbytes, dev), 3, True, 1500.0)
        return time_rounds(rounds, 5)


def gemm_probe(args: argparse.Namespace) -> None:
    from fp8linear.ops.cublas_gemm import cublas_row_scales, cublas_weight_scale
    from fp8linear.ops.cublas_gemm import CublasConfig
    from fp8linear.ops.cublaslt import LtBlockGemm, torch_workspace_limit
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.quant import act_quant
    from fp8linear.tools.timing import prepare_cuda, rotation_sets, time_rounds

    dev = torch.device("cuda")
    shapes = _shapes(args, SHAPES)
    print(f"{torch.cuda.get_device_name()}; GEMM us per call under CUDA graphs")
    print(f"{'shape':>12s} {'M':>5s} {'bf16':>6s} {'p-tens':>6s} {'ours':>6s} {'lt-1M':>6s} {'lt-32M':>6s}"
          f" {'best':>6s} idx  ws-MiB  best/ours  min(lt,ours)/bf16")
    for n, k in shapes:
        w, w_q, w_s = _block_weight(n, k, dev)
        rows_scales = cublas_row_scales(w_q, "block")  # the 128x128 grid (padded where needed)
        scale_b = cublas_weight_scale(w_q, w_s, "block", rows_scales)
        small = LtBlockGemm.for_weight(w_q, scale_b, rows_scales, None, workspace_limit=torch_workspace_limit())
        big = LtBlockGemm.for_weight(w_q, scale_b, rows_scales, None,
                                     workspace_limit=CublasConfig(workspace_mib=32).workspace_limit)
        one = torch.ones((), device=dev)
        for m in args.m:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = act_quant(x, torch.float8_e4m3fn)
            xp_q, xp_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
            rows = xp_q.shape[0]
            plans = {"lt-1M": small.plan(rows), "lt-32M": big.plan(rows)}
            cands = big.candidate_plans(rows, args.algos)
            fns = {"bf16": (lambda a, b: a @ b.t(), (x, w)),
                   "p-tens": (lambda a, b: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one,
                                                            out_dtype=torch.bfloat16), (x_q, w_q)),
                   "ours": (lambda a, sa: block_fp8_gemm(a, sa, w_q, w_s, "block", torch.bfloat16), (x_q, x_s))}

            for name, plan in plans.items():
                if plan is not None:
                    fns[name] = (_lt_call(small if name == "lt-1M" else big, plan, rows, n, dev), (xp_q, xp_s))
            for i, plan in enumerate(cands):
                fns[f"algo{i}"] = (_lt_call(big, plan, rows, n, dev), (xp_q, xp_s))
            rounds = {}
            with torch.inference_mode():
                for name, (fn, fargs) in fns.items():
                    nbytes = sum(t.numel() * t.element_size() for t in fargs)
                    try:
                        rounds[name], _ = prepare_cuda(fn, rotation_sets(fargs, nbytes, dev), 3, True, 1500.0)
                    except RuntimeError as e:
                        print(f"  {name}: {str(e).splitlines()[0][:100]}")
                us = time_rounds(rounds, 5)
                del rounds
            algo_us = {int(k_[4:]): v for k_, v in us.items() if k_.startswith("algo")}
            best_i = min(algo_us, key=algo_us.get) if algo_us else -1
            best = algo_us.get(best_i, float("nan"))
            nan = float("nan")
            lt = us.get("lt-32M", nan)
            print(f"{n:>5d}x{k:<6d} {m:5d} {us['bf16']:6.1f} {us['p-tens']:6.1f} {us['ours']:6.1f}"
                  f" {us.get('lt-1M', nan):6.1f} {lt:6.1f} {best:6.1f} {best_i:3d}"
                  f" {(cands[best_i][3] if best_i >= 0 else 0) / 2**20:7.2f} {best / us['ours']:9.2f}"
                  f" {min(lt, us['ours']) / us['bf16']:8.2f}")
        del w, w_q, w_s, small, big
        torch.cuda.empty_cache()


BORROW_SHAPES = [(7168, 2048), (32768, 512), (2112, 7168), (2048, 7168), (1536, 7168), (24576, 1536), (4096, 4096),
                 (3584, 3584), (8192, 8192), (14336, 4096), (4096, 14336), (8192, 29568), (7168, 18432), (1024, 8192)]


def borrow_probe(args: argparse.Namespace) -> None:
    """Per (shape, M) whose routes-table entry is cuBLAS measured at another M (M_t): the GEMM at M
    with cuBLASLt's heuristic for M ("heur", what runs now), with the algorithm chosen for M_t
    ("borrow"), and on M_t rows ("pad": M padded to the measured M), against BF16 and ours."""
    from fp8linear.ops.cublas_gemm import cublas_row_scales, cublas_weight_scale, workspace_limit
    from fp8linear.ops.cublaslt import LtBlockGemm
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.quant import act_quant, cublas_rows
    from fp8linear.ops.route_table import MAX_M_RATIO, _device_name, _table

    dev = torch.device("cuda")
    table = _table(_device_name(torch.cuda.current_device()), "block")
    ms = args.m if args.m != [64, 128, 512, 2048] else [77, 160, 320, 333, 640, 1000, 1500, 3000]
    shapes = _shapes(args, BORROW_SHAPES)
    print(f"{torch.cuda.get_device_name()}; GEMM us per call under CUDA graphs")
    print(f"{'shape':>12s} {'M':>5s} {'M_t':>5s} ws {'bf16':>7s} {'ours':>7s} {'heur':>7s} {'borrow':>7s} {'pad':>7s}"
          f"  borrow/heur pad/heur")
    ratios = {"borrow": [], "pad": []}
    for n, k in shapes:
        per_m = table.get((n, k))
        if not per_m:
            continue
        w, w_q, w_s = _block_weight(n, k, dev)
        gemms = {}
        for m in ms:
            above = [mm for mm in per_m if m <= mm <= m * MAX_M_RATIO]
            below = [mm for mm in per_m if mm < m and m <= mm * MAX_M_RATIO]
            m_t = min(above) if above else (max(below) if below else None)
            if m_t is None or per_m[m_t].kernel != "cublas" or m_t == cublas_rows(m):
                continue
            limit = workspace_limit(per_m[m_t].config)
            as_rows = cublas_row_scales(w_q, "block", per_m[m_t].config)  # the table entry's scale form
            if (limit, as_rows) not in gemms:
                gemms[(limit, as_rows)] = LtBlockGemm.for_weight(
                    w_q, cublas_weight_scale(w_q, w_s, "block", as_rows), as_rows, None, limit)
            gemm = gemms[(limit, as_rows)]
            x = torch.randn(max(m, m_t), k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = act_quant(x[:m], torch.float8_e4m3fn)
            xp_q, xp_s = act_quant(x[:m], torch.float8_e4m3fn, cublas_layout=True)
            xt_q, xt_s = act_quant(x[:m_t], torch.float8_e4m3fn, cublas_layout=True)
            rows = xp_q.shape[0]
            plans = {"heur": (gemm.plan(rows), rows, (xp_q, xp_s)), "borrow": (gemm.borrowed_plan(rows, m_t), rows, (xp_q, xp_s)),
                     "pad": (gemm.plan(cublas_rows(m_t)), cublas_rows(m_t), (xt_q, xt_s))}

            fns = {"bf16": (lambda a, b: a @ b.t(), (x[:m], w)),
                   "ours": (lambda a, sa: block_fp8_gemm(a, sa, w_q, w_s, "block", torch.bfloat16), (x_q, x_s))}
            for name, (plan, r, fargs) in plans.items():
                if plan is not None:
                    fns[name] = (_lt_call(gemm, plan, r, n, dev), fargs)
            us = _graph_us(fns, dev)
            nan = float("nan")
            for name in ratios:
                if name in us:
                    ratios[name].append(us[name] / us["heur"])
            print(f"{n:>5d}x{k:<6d} {m:5d} {m_t:5d} {limit >> 20:2d} {us['bf16']:7.1f} {us['ours']:7.1f}"
                  f" {us['heur']:7.1f} {us.get('borrow', nan):7.1f} {us.get('pad', nan):7.1f}"
                  f"  {us.get('borrow', nan) / us['heur']:8.2f} {us.get('pad', nan) / us['heur']:8.2f}")
        del w, w_q, w_s, gemms
        torch.cuda.empty_cache()
    for name, r in ratios.items():
        if r:
            geo = math.exp(sum(math.log(v) for v in r) / len(r))
            print(f"{name}/heur: geomean {geo:.3f} over {len(r)} cases, min {min(r):.2f}, max {max(r):.2f}")


PADDED_GRID_SHAPES = [(8192, 29568), (2048, 1408), (7168, 640), (4096, 384), (7168, 2304), (1536, 576), (576, 2112)]


def padded_grid_probe(args: argparse.Namespace) -> None:
    from fp8linear.ops.cublaslt import LtBlockGemm
    from fp8linear.ops.gemm import block_fp8_gemm
    from fp8linear.ops.quant import act_quant
    from fp8linear.reference import block_fp8_matmul_ref

    dev = torch.device("cuda")
    ms = args.m if args.m != [64, 128, 512, 2048] else [4, 77, 128, 333, 512, 2048, 4096]
    print(f"{torch.cuda.get_device_name()}; GEMM us per call under CUDA graphs; rel err vs float64 reference\n"
          f"{'shape':>12s} {'M':>5s} {'bf16':>7s} {'ours':>7s} {'row':>7s} {'blk-pad':>7s} {'blk-raw':>7s}"
          f" {'err row':>8s} {'err pad':>8s} {'err raw':>8s} {'err ours':>8s}  pad/row  unpadded-M err")
    for n, k in _shapes(args, PADDED_GRID_SHAPES):
        w, w_q, w_s = _block_weight(n, k, dev)
        groups = w_s.shape[1]
        padded = torch.zeros((w_s.shape[0], -(-groups // 4) * 4), device=dev, dtype=torch.float32)
        padded[:, :groups] = w_s
        # each block scale repeated over its 128 rows: the same weight as 1x128 scales, (K/128, N)
        row_scale = w_s.t().repeat_interleave(128, dim=1)[:, :n].contiguous()
        big = 32 << 20
        gemms = {"row": LtBlockGemm.for_weight(w_q, row_scale, True, None),
                 "blk-pad": LtBlockGemm.for_weight(w_q, padded.t(), False, None),
                 "blk-raw": LtBlockGemm.for_weight(w_q, w_s.contiguous().t(), False, None),
                 "row-32M": LtBlockGemm.for_weight(w_q, row_scale, True, None, big),
                 "pad-32M": LtBlockGemm.for_weight(w_q, padded.t(), False, None, big)}
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            x_q, x_s = act_quant(x, torch.float8_e4m3fn)
            xp_q, xp_s = act_quant(x, torch.float8_e4m3fn, cublas_layout=True)
            rows = xp_q.shape[0]
            ref = block_fp8_matmul_ref(x_q, x_s, w_q, w_s, torch.float32)
            ref = ref.double()

            def err(y: torch.Tensor) -> float:
                return ((y[:m].double() - ref).norm() / ref.norm()).item()

            fns = {"bf16": (lambda a, b: a @ b.t(), (x, w)),
                   "ours": (lambda a, sa: block_fp8_gemm(a, sa, w_q, w_s, "block", torch.bfloat16, allow_cublas=True),
                            (x_q, x_s))}
            errs = {"ours": err(block_fp8_gemm(x_q, x_s, w_q, w_s, "block", torch.bfloat16, allow_cublas=True))}
            for name, gemm in gemms.items():
                plan = gemm.plan(rows)
                if plan is None:
                    continue
                fn = _lt_call(gemm, plan, rows, n, dev)
                errs[name] = err(fn(xp_q, xp_s))
                fns[name] = (fn, (xp_q, xp_s))
            # M rows (no padded copy of x_q), activation scales with the leading dimension padded to 4
            unpadded = "-"
            if m % 4:
                plan_m = gemms["blk-pad"].plan(m)
                if plan_m is None:
                    unpadded = "no algo"
                else:
                    xq_m = xp_q[:m].clone()
                    y = _lt_call(gemms["blk-pad"], plan_m, m, n, dev)(xq_m, xp_s)
                    unpadded = f"{err(y):.2e}"
            us = _graph_us(fns, dev)
            nan = float("nan")
            print(f"{n:>5d}x{k:<6d} {m:5d} {us['bf16']:7.1f} {us['ours']:7.1f} {us.get('row', nan):7.1f}"
                  f" {us.get('blk-pad', nan):7.1f} {us.get('blk-raw', nan):7.1f} {errs.get('row', nan):8.1e}"
                  f" {errs.get('blk-pad', nan):8.1e} {errs.get('blk-raw', nan):8.1e} {errs['ours']:8.1e}"
                  f" {us.get('blk-pad', nan) / us.get('row', nan):7.2f}  {unpadded}"
                  f"  32M: row {us.get('row-32M', nan):7.1f} pad {us.get('pad-32M', nan):7.1f}"
                  f"  best-row/best-pad {min(us.get('row', nan), us.get('row-32M', nan)) / min(us.get('blk-pad', nan), us.get('pad-32M', nan)):5.2f}")
        del w, w_q, w_s, gemms
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
