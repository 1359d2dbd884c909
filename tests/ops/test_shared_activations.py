"""Sibling FP8 linears quantizing their common input once (fp8linear.ops.linear.SharedActivations,
fp8linear.share_input_quantization): the entry's rules on any device, the grouping, and on a GPU
the same bits as ungrouped layers with fewer quantization launches."""

from __future__ import annotations

import copy
import gc
import io
import pickle
import weakref

import pytest
import torch
from torch import nn

from fp8linear import Fp8BlockLinear, share_input_quantization
from fp8linear.ops import HAS_TRITON

from _utils import same_bits, spy_cutlass_library_calls

pytestmark = pytest.mark.skipif(not HAS_TRITON, reason="Triton is not installed")

KEY = (4, 8, torch.float8_e4m3fn, "row-major")


def _shared(readers: int = 2):
    """A group whose `readers` linears' plans read KEY's layout."""
    from fp8linear.ops.linear import SharedActivations

    share = SharedActivations()
    weights = [torch.empty(1) for _ in range(readers)]
    for w in weights:
        share.register(KEY, w)
    _WEIGHTS.append(weights)  # alive for the test, as a layer keeps its weight: ids stay distinct
    return share


_WEIGHTS: list = []


def test_entries_only_for_layouts_two_linears_read():
    from fp8linear.ops.linear import SharedActivations

    share, x, w1, w2 = SharedActivations(), torch.randn(4, 8), torch.empty(1), torch.empty(1)
    share.publish(x, KEY, 100, 200, torch.empty(1))
    assert share.lookup(x, KEY) is None  # no linear reads it: nothing kept alive
    share.register(KEY, w1)
    share.register(KEY, w1)  # a second plan of the same linear counts once
    share.publish(x, KEY, 100, 200, torch.empty(1))
    assert share.lookup(x, KEY) is None
    share.register((8, 8, torch.float8_e4m3fn, "row-major"), w2)  # another layout
    share.publish(x, KEY, 100, 200, torch.empty(1))
    assert share.lookup(x, KEY) is None
    share.register(KEY, w2)
    share.publish(x, KEY, 100, 200, torch.empty(1))
    assert share.lookup(x, KEY) == (100, 200)


def test_an_entry_serves_only_the_same_unmodified_tensor():
    share, x, keep = _shared(), torch.randn(4, 8), torch.empty(16)
    share.publish(x, KEY, 100, 200, keep)
    assert share.lookup(x, KEY) == (100, 200)
    assert share.lookup(x.clone(), KEY) is None  # equal values, another tensor
    assert share.lookup(x, (*KEY[:3], "m-major")) is None  # another layout
    assert share.lookup(x.view(4, 8), KEY) is None  # a view is another tensor object
    x.add_(1)  # modified in place since
    assert share.lookup(x, KEY) is None


def test_an_entry_lives_as_long_as_its_input():
    share, x, keep = _shared(), torch.randn(4, 8), torch.empty(16)
    share.publish(x, KEY, 100, 200, keep)
    kept = weakref.ref(keep)
    del keep
    gc.collect()
    assert kept() is not None  # held while x lives
    del x
    gc.collect()
    assert kept() is None  # freed with x
    y = torch.randn(4, 8)
    assert share.lookup(y, KEY) is None


def test_a_new_entry_replaces_the_last():
    share, x, y = _shared(), torch.randn(4, 8), torch.randn(4, 8)
    share.publish(x, KEY, 1, 2, torch.empty(1))
    share.publish(y, KEY, 3, 4, torch.empty(1))
    assert share.lookup(x, KEY) is None and share.lookup(y, KEY) == (3, 4)
    del x
    gc.collect()  # the replaced entry's input dying does not drop the current one
    assert share.lookup(y, KEY) == (3, 4)


def test_inference_tensors_and_other_streams_are_not_shared(monkeypatch):
    from fp8linear.ops import linear

    share = _shared()
    with torch.inference_mode():
        x = torch.randn(4, 8)
    share.publish(x, KEY, 1, 2, torch.empty(1))  # no version counter: not offered
    assert share.lookup(x, KEY) is None
    y = torch.randn(4, 8)
    share.publish(y, KEY, 1, 2, torch.empty(1))
    monkeypatch.setattr(linear, "_stream_of", lambda t: 12345)
    assert share.lookup(y, KEY) is None  # enqueued on another stream than the quantization


class _Attention(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.q = Fp8BlockLinear(width, 256, bias=False)
        self.k = Fp8BlockLinear(width, 128, bias=False)
        self.v = Fp8BlockLinear(width, 128, bias=False)
        self.o = Fp8BlockLinear(256, width, bias=False)


class _Block(nn.Module):
    def __init__(self, width: int = 128) -> None:
        super().__init__()
        self.attn = _Attention(width)
        self.gate = Fp8BlockLinear(width, 384, bias=False)
        self.up = Fp8BlockLinear(width, 384, bias=False)
        self.down = Fp8BlockLinear(384, width, bias=False)
        self.head = nn.Linear(width, 10)


def test_a_copied_group_is_empty():
    share = _shared()
    x = torch.randn(4, 8)
    share.publish(x, KEY, 1, 2, torch.empty(1))
    assert share.lookup(x, KEY) == (1, 2)
    for twin in (copy.deepcopy(share), pickle.loads(pickle.dumps(share))):
        assert twin.lookup(x, KEY) is None and twin._users == {}


def test_share_input_quantization_groups_siblings_of_one_width():
    block = _Block()
    assert share_input_quantization(block) == 2
    a = block.attn
    assert a.q._input_share is a.k._input_share is a.v._input_share is not None
    assert a.o._input_share is None  # 256 wide: alone
    assert block.gate._input_share is block.up._input_share is not None
    assert block.gate._input_share is not a.q._input_share and block.down._input_share is None
    twin = copy.deepcopy(block)  # a copy keeps its grouping, in new empty groups of its own
    assert twin.gate._input_share is twin.up._input_share is not None
    assert twin.gate._input_share is not block.gate._input_share
    assert twin.attn.q._input_share is twin.attn.k._input_share is not twin.gate._input_share
    assert twin.attn.o._input_share is None and twin.down._input_share is None
    buf = io.BytesIO()
    torch.save(block, buf)
    buf.seek(0)
    thawed = torch.load(buf, weights_only=False)
    assert thawed.gate._input_share is thawed.up._input_share is not None
    with pytest.raises(TypeError, match="SharedActivations or None"):
        block.gate.set_input_share(object())
    with pytest.raises(TypeError, match="takes an nn.Module"):
        share_input_quantization([block])


def test_grouped_layers_on_the_interpreter_give_the_ungrouped_bits(monkeypatch):
    """The plans of grouped layers (their layouts registered with the group) run as ungrouped ones
    where the launches are not direct (the CPU interpreter: nothing is shared there)."""
    from conftest import KERNEL_DEVICE
    from fp8linear.ops import router

    monkeypatch.setattr(router, "ONE_LAUNCH_MAX_MNK", 0)  # two launches: act_quant, then the GEMM

    torch.manual_seed(3)
    lins = [nn.Linear(256, n, bias=False, device=KERNEL_DEVICE, dtype=torch.bfloat16) for n in (130, 96)]
    grouped = [Fp8BlockLinear.from_linear(lin, "block", backend="triton") for lin in lins]
    alone = [Fp8BlockLinear.from_linear(lin, "block", backend="triton") for lin in lins]
    parent = nn.Module()
    parent.a, parent.b = grouped
    assert share_input_quantization(parent) == 1
    x = torch.randn(300, 256, device=KERNEL_DEVICE, dtype=torch.bfloat16)
    for _ in range(3):  # routed, then planned
        got = [layer(x) for layer in grouped]
    assert all(same_bits(g, layer(x)) for g, layer in zip(got, alone))
    kinds = {layer._plans[(x.shape, x.dtype, x.device)].route.kernel for layer in grouped}
    if kinds <= {"tiled", "splitk"}:  # both read the row-major layout: registered by both plans
        assert list(map(len, parent.a._input_share._users.values())) == [2]


# ----------------------------------------------------------------------------- GPU
def _count_quant_launches(monkeypatch) -> list[int]:
    """A counter of act_quant launches, and of the CUTLASS plans' quantizations in the library's call
    (those of plans made after this call)."""
    from fp8linear.ops import launch
    from fp8linear.ops.quant import _act_quant_kernel

    count, orig = [0], launch.KernelCall.launch

    def spy(self, *args):
        if self.kernel is _act_quant_kernel:
            count[0] += 1
        return orig(self, *args)

    def library_call(method, args):
        count[0] += 1

    monkeypatch.setattr(launch.KernelCall, "launch", spy)
    spy_cutlass_library_calls(monkeypatch, library_call)
    return count


def _qkv(k: int, backend: str | None, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    parent = nn.Module()
    for name, n in (("q", 2112), ("k", 576), ("v", 1536)):
        lin = nn.Linear(k, n, bias=name == "k", device="cuda", dtype=torch.bfloat16)
        setattr(parent, name, Fp8BlockLinear.from_linear(lin, "block", backend=backend))
    return parent


# Routes whose plans quantize x outside the GEMM kernel (a launch, or the CUTLASS library's call), and the
# scale layout each reads.
_LAYOUT = {"cublas": "m-major", "tiled": "row-major", "splitk": "row-major", "cutlass": "row-major"}


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", None])
@pytest.mark.parametrize("m", [96, 333, 1024, 2000])
def test_a_group_gives_the_ungrouped_bits_with_fewer_quantizations(m, backend, monkeypatch):
    """One quantization launch per scale layout among the members that quantize x apart (the
    one-launch kernels quantize inside, and run as before); the bits of ungrouped layers."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    grouped, alone = _qkv(7168, backend, 0), _qkv(7168, backend, 0)
    assert share_input_quantization(grouped) == 1
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    names = ("q", "k", "v")
    count = _count_quant_launches(monkeypatch)
    for _ in range(2):  # the first call of a shape is routed, the second makes the plans
        for name in names:
            getattr(grouped, name)(x)
    # a new input: an entry published for x in the rounds above would still serve x
    x = torch.randn(m, 7168, device="cuda", dtype=torch.bfloat16)
    count[0] = 0
    got = [getattr(grouped, name)(x) for name in names]
    launched = count[0]
    want = [getattr(alone, name)(x) for name in names]
    assert all(same_bits(g, w) for g, w in zip(got, want))
    kernels = [getattr(grouped, name)._plans[(x.shape, x.dtype, x.device)].route.kernel for name in names]
    layouts = [_LAYOUT[kind] for kind in kernels if kind in _LAYOUT]
    assert launched == len(set(layouts)), kernels
    if backend == "triton" and m == 1024:
        assert kernels.count("tiled") + kernels.count("splitk") == 3 and launched == 1  # shared by all three


@pytest.mark.gpu
def test_an_input_modified_in_place_is_quantized_again(monkeypatch):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    grouped, alone = _qkv(7168, "triton", 1), _qkv(7168, "triton", 1)
    share_input_quantization(grouped)
    x = torch.randn(1024, 7168, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        grouped.q(x), grouped.k(x)
    count = _count_quant_launches(monkeypatch)
    grouped.q(x)
    x.mul_(2)
    y = grouped.k(x)
    assert count[0] == 2
    assert same_bits(y, alone.k(x))


@pytest.mark.gpu
def test_cuda_graph_replays_of_a_group_read_their_own_quantization():
    """Captured calls share nothing (an eager entry's buffer is not the graph's): replays after x
    changed give what ungrouped layers captured in the same graph give."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    grouped, alone = _qkv(7168, None, 2), _qkv(7168, None, 2)
    share_input_quantization(grouped)
    x = torch.randn(1024, 7168, device="cuda", dtype=torch.bfloat16)
    names = ("q", "k", "v")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # plans made, and an eager entry published for x
            for layers in (grouped, alone):
                [getattr(layers, name)(x) for name in names]
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = [getattr(grouped, name)(x) for name in names]
        want = [getattr(alone, name)(x) for name in names]
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    assert all(same_bits(g, w) for g, w in zip(got, want))
