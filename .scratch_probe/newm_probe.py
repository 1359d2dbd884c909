import time, torch
from fp8linear import quantize_weight
from fp8linear.ops.linear import CublasLinear
from fp8linear.ops.cublaslt import LtBlockGemm, torch_workspace_limit
dev = torch.device("cuda")
for n, k in ((32768, 512), (7168, 2048)):
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    w_q, w_s = quantize_weight(w, "block")
    cl = CublasLinear(w_q, w_s, "block", None, direct=True)
    x = torch.randn(4096, k, device=dev, dtype=torch.bfloat16)
    for m in (2000, 2001):
        cl(x[:m]); torch.cuda.synchronize()
    # new M each call vs the same M
    def wall(ms):
        torch.cuda.synchronize(); t0 = time.perf_counter()
        for m in ms: cl(x[:m])
        torch.cuda.synchronize(); return (time.perf_counter() - t0) / len(ms) * 1e6
    new = wall(list(range(2100, 2164, 4)))
    seen = wall([2100] * 16)
    t0 = time.perf_counter()
    for m in range(3000, 3064, 4): cl.lt._make_plan(m)
    plan_us = (time.perf_counter() - t0) / 16 * 1e6
    small = LtBlockGemm.for_weight(w_q, cl.scale_b, False, None, workspace_limit=torch_workspace_limit())
    t0 = time.perf_counter()
    for m in range(3000, 3064, 4): small._make_plan(m)
    plan_small = (time.perf_counter() - t0) / 16 * 1e6
    t0 = time.perf_counter()
    for m in range(3000, 3064, 4): cl.lt._make_plan(m)
    plan_again = (time.perf_counter() - t0) / 16 * 1e6
    print(f"{n}x{k}: call at a new M {new:.1f} us, at a seen M {seen:.1f} us; plan {plan_us:.1f} us (again {plan_again:.1f}), at torch's limit {plan_small:.1f}")
