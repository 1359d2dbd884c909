"""The MI300X (fnuz) pipeline end to end on CPU: `fp8linear quantize --fp8-dtype e4m3fnuz` -> load ->
forward and greedy `generate` through the Triton kernels (CPU interpreter) with e4m3fnuz tensors,
against the same checkpoint run by the PyTorch reference and against the BF16 model.
"""

from __future__ import annotations

import os

import pytest
import torch
from _checkpoints import make_model, read_tensors, save_model

from fp8linear.cli import main as cli_main
from fp8linear.formats import fp8_max

# e4m3fnuz kernels run on ROCm (MI300X) and in the CPU interpreter; NVIDIA GPUs have no fnuz MMA.
pytestmark = pytest.mark.skipif(
    (torch.cuda.is_available() and torch.version.hip is None)
    or (not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")),
    reason="needs a ROCm GPU or TRITON_INTERPRET=1 without a GPU",
)
PROMPT_LEN, NEW_TOKENS = 6, 3


@pytest.fixture(autouse=True, scope="module")
def _single_thread(single_thread):
    """Every test here runs on one intra-op thread (conftest.single_thread)."""


@pytest.fixture(scope="module")
def fnuz_checkpoint(tmp_path_factory):
    """(bf16 model, folder written by `fp8linear quantize --fp8-dtype e4m3fnuz`)."""
    root = tmp_path_factory.mktemp("fnuz")
    model = make_model("llama")  # hidden 320, intermediate 200: partial 128-blocks in N and K
    src = save_model(model, root / "bf16")
    rc = cli_main(["quantize", str(src), str(root / "fp8"), "--fp8-dtype", "e4m3fnuz", "--quiet"])
    assert rc == 0
    return model, root / "fp8"


def _kernel_spy(monkeypatch):
    """Record (kernel name, dtypes of its tensor arguments) of every interpreted Triton launch."""
    if torch.cuda.is_available():
        return None
    from triton.runtime.interpreter import InterpretedFunction

    calls: list[tuple[str, set[torch.dtype]]] = []
    original = InterpretedFunction.__getitem__

    def getitem(self, grid):
        run = original(self, grid)

        def call(*args, **kwargs):
            values = list(args) + list(kwargs.values())
            calls.append((self.fn.__name__, {a.dtype for a in values if isinstance(a, torch.Tensor)}))
            return run(*args, **kwargs)

        return call

    monkeypatch.setattr(InterpretedFunction, "__getitem__", getitem)
    return calls


def test_quantize_writes_valid_fnuz(fnuz_checkpoint):
    _, folder = fnuz_checkpoint
    tensors = read_tensors(folder)
    weights = {n: t for n, t in tensors.items() if t.dtype == torch.float8_e4m3fnuz}
    assert weights and all(n + "_scale_inv" in tensors for n in weights)
    for name, w in weights.items():
        bits = w.view(torch.uint8)
        assert not (bits == 0x80).any(), f"{name}: 0x80 is NaN in e4m3fnuz"
        assert w.float().abs().max() <= fp8_max(torch.float8_e4m3fnuz), name


def test_fnuz_forward_and_generate_through_triton(fnuz_checkpoint, monkeypatch):
    from fp8linear.integrations.transformers import from_pretrained

    bf16, folder = fnuz_checkpoint
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ref = from_pretrained(folder, device_map={"": device}, backend="reference")
    tri = from_pretrained(folder, device_map={"": device}, backend="triton")
    fp8_params = [p for p in tri.parameters() if p.dtype == torch.float8_e4m3fnuz]
    assert fp8_params and not [p for p in tri.parameters() if p.dtype == torch.float8_e4m3fn]

    gen = torch.Generator().manual_seed(3)
    prompt = torch.randint(1, 384, (1, PROMPT_LEN), generator=gen).to(device)
    calls = _kernel_spy(monkeypatch)
    with torch.no_grad():
        logits_tri = tri(prompt).logits.float()
        logits_ref = ref(prompt).logits.float()
        logits_bf16 = bf16.to(device)(prompt).logits.float()
    if calls is not None:  # the interpreter ran our kernels on e4m3fnuz operands
        # the prompt's 6 rows run, eagerly, the one-launch decode kernel in the interpreter (ROCm
        # would run act_quant + GEMM); generated tokens run the fused GEMV
        gemms = {"_block_fp8_gemm_kernel", "_splitk_fp8_gemm_kernel", "_fused_decode_kernel", "_fused_fp8_gemv_kernel"}
        names = {n for n, _ in calls}
        assert names & gemms, names
        assert all(torch.float8_e4m3fnuz in dtypes for n, dtypes in calls if n in gemms)
        assert not any(torch.float8_e4m3fn in dtypes for _, dtypes in calls)
    # Triton vs reference on the same fnuz checkpoint differ by rounding only (fp32 summation order,
    # bf16 layer outputs; ~0.4% per layer, 3.6% on the logits of this tiny random model, 3.4% for
    # e4m3fn): well below the FP8 error itself, and the Triton path is as close to BF16 as the
    # reference is. A wrong fnuz scale (bias 8 vs 7: a factor 2) or clamp would break both.
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    diff_kernel = rel(logits_tri, logits_ref)
    ref_err, tri_err = rel(logits_ref, logits_bf16), rel(logits_tri, logits_bf16)
    assert ref_err < 0.1, ref_err  # fnuz quantization itself is sound
    assert diff_kernel < 0.6 * ref_err, (diff_kernel, ref_err)
    assert tri_err < 1.1 * ref_err, (tri_err, ref_err)

    kwargs = dict(max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        out_tri = tri.generate(prompt, **kwargs)
        out_ref = ref.generate(prompt, **kwargs)
    assert out_tri.shape == (1, PROMPT_LEN + NEW_TOKENS)
    assert torch.equal(out_tri, out_ref)
    if calls is not None:  # single-token decode steps ran a decode kernel on fnuz weights
        assert {"_fused_fp8_gemv_kernel", "_splitk_fp8_gemm_kernel", "_block_fp8_gemm_kernel"} & {
            n for n, _ in calls[len(calls) // 2:]}
