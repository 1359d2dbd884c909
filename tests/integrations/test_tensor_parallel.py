"""Tensor parallelism of FP8 models on CPU: 2 processes with gloo against one process.

The pytest process builds tiny DeepSeek-V3 and Llama models, quantizes and saves them, and
runs the single-process FP8 model for reference logits and greedy tokens; one ``torchrun
--nproc-per-node 2`` launch of this file (``__main__`` below) then loads and runs every case
under tensor parallelism and writes what each rank saw to JSON. Dimensions are multiples of
256 so every sharded layer splits on 128 boundaries at tp=2.

Tolerances: in float32 the TP model computes the same products; only the rowwise layers'
K-sums are split into two fp32 partial sums added by the all-reduce (reassociation, ~1e-7
relative per layer), so float32 logits agree to 1e-5 of their range except where a last-bit
difference flips an FP8 activation rounding (see _assert_float32_match), and greedy tokens
exactly. In bfloat16 each rowwise partial output is rounded to bf16 before the all-reduce
and the sum is rounded again, where one process rounds once; the test requires the TP
difference at the median position to stay within the single-process model's own bf16
rounding error (its bf16 logits against its float32-activation logits). Greedy tokens of these
random tiny models are near ties and are compared in float32 only. Any sharding mistake (a
scale grid off by a block, gate/up halves swapped, a bias added twice) moves logits by O(1)
of their range at every position.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

GEN_TOKENS = 6
KINDS = ("deepseek_v3", "llama")


# ----------------------------------------------------------------------------- models
def make_model(kind: str, seed: int = 0) -> nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, DeepseekV3Config, LlamaConfig

    if kind == "deepseek_v3":
        cfg = DeepseekV3Config(
            vocab_size=384, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4,
            n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, first_k_dense_replace=1,
            q_lora_rank=256, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64,
            max_position_embeddings=64, tie_word_embeddings=False,
        )  # fmt: skip
    elif kind == "llama":
        cfg = LlamaConfig(
            vocab_size=384, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=2, head_dim=128, max_position_embeddings=64,
            tie_word_embeddings=False,
        )  # fmt: skip
    else:
        raise ValueError(kind)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.05)
    for mod in model.modules():
        if hasattr(mod, "e_score_correction_bias"):
            mod.e_score_correction_bias = mod.e_score_correction_bias.float() + 0.05 * torch.randn(
                mod.e_score_correction_bias.shape
            )
    return model.eval()


def input_ids() -> torch.Tensor:
    return torch.randint(0, 384, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def run_model(model: nn.Module) -> dict:
    x = input_ids().to(next(model.parameters()).device)
    logits = model(x).logits.float()
    gen = model.generate(x, max_new_tokens=GEN_TOKENS, do_sample=False, pad_token_id=0)
    return {"logits": logits.tolist(), "tokens": gen[:, x.shape[1]:].tolist()}


def sharded_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes this rank holds, bytes of the full tensors) over the DTensor parameters (sharded modules)."""
    from torch.distributed.tensor import DTensor

    local = full = 0
    for p in model.parameters():
        if isinstance(p, DTensor):
            local += p.to_local().numel() * p.element_size()
            full += p.numel() * p.element_size()
    return local, full


def write_case(tmp: Path, kind: str) -> Path:
    """Save a tiny model in bf16 (folder + "_bf16") and quantized to FP8; returns the FP8 folder."""
    from fp8linear.integrations.transformers import quantize_model_, save_pretrained

    model = make_model(kind)
    path = tmp / kind
    model.save_pretrained(str(path) + "_bf16")
    quantize_model_(model, granularity="block", fp8_dtype=torch.float8_e4m3fn, backend="reference")
    save_pretrained(model, path)
    if kind == "deepseek_v3":
        _write_per_expert(path, Path(str(path) + "_official"))
    return path


def _write_per_expert(src: Path, dst: Path) -> None:
    """The FP8 checkpoint at `src` in the official DeepSeek-V3 layout (one tensor per expert and
    projection, two files with an index). Exact: the intermediate size is a multiple of 128, so
    gate and up rows and their 128x128 scale rows split apart without requantizing."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    tensors = {}
    for file in sorted(src.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for k in f.keys():
                tensors[k] = f.get_tensor(k)
    out = {}
    for k, t in tensors.items():
        prefix, _, leaf = k.rpartition(".")
        if not prefix.endswith(".experts"):
            out[k] = t
            continue
        scale = leaf.endswith("_scale_inv")
        proj = leaf.removesuffix("_scale_inv")
        suffix = "weight_scale_inv" if scale else "weight"
        for j in range(t.shape[0]):
            if proj == "gate_up_proj":
                half = t.shape[1] // 2
                out[f"{prefix}.{j}.gate_proj.{suffix}"] = t[j, :half].contiguous()
                out[f"{prefix}.{j}.up_proj.{suffix}"] = t[j, half:].contiguous()
            else:
                out[f"{prefix}.{j}.{proj}.{suffix}"] = t[j].contiguous()
    dst.mkdir()
    names = sorted(out)
    weight_map = {}
    for i, part in enumerate((names[: len(names) // 2], names[len(names) // 2 :])):
        fname = f"model-{i + 1:05d}-of-00002.safetensors"
        save_file({n: out[n] for n in part}, str(dst / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, fname))
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for extra in ("config.json", "generation_config.json"):
        if (src / extra).is_file():
            shutil.copy(src / extra, dst / extra)


# ----------------------------------------------------------------------------- worker (torchrun)
class _CountingOpen:
    """Wraps safetensors.safe_open: bytes returned by get_tensor (whole tensors) and by slices."""

    whole: dict[str, int] = {}
    sliced: dict[str, int] = {}
    full: dict[str, int] = {}  # whole-tensor bytes of the tensors read through slices
    _ITEM = {"F8_E4M3": 1, "F8_E5M2": 1, "BF16": 2, "F16": 2, "F32": 4, "I64": 8}

    def __init__(self, *args, **kwargs):
        from safetensors import _safe_open_orig  # set in _worker

        self._h = _safe_open_orig(*args, **kwargs)

    def __enter__(self):
        self._h.__enter__()
        return self

    def __exit__(self, *exc):
        return self._h.__exit__(*exc)

    def keys(self):
        return self._h.keys()

    def get_tensor(self, name):
        t = self._h.get_tensor(name)
        _CountingOpen.whole[name] = t.numel() * t.element_size()
        return t

    def get_slice(self, name):
        sl = self._h.get_slice(name)
        numel = 1
        for d in sl.get_shape():
            numel *= d
        _CountingOpen.full[name] = numel * _CountingOpen._ITEM[sl.get_dtype()]

        class _Slice:
            def get_shape(self):
                return sl.get_shape()

            def get_dtype(self):
                return sl.get_dtype()

            def __getitem__(self, idx):
                t = sl[idx]
                _CountingOpen.sliced[name] = _CountingOpen.sliced.get(name, 0) + t.numel() * t.element_size()
                return t

        return _Slice()


def _layers_case() -> dict:
    """Colwise (with bias) then rowwise (with bias) Fp8BlockLinear pair through torch's own
    parallelize_module, per granularity: max |TP - one process| and max |one process|."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8linear import Fp8BlockLinear
    from fp8linear.integrations.tensor_parallel import Fp8ColwiseParallel, Fp8RowwiseParallel

    mesh = init_device_mesh("cpu", (2,))
    out = {}
    for gran in ("block", "row", "tensor"):
        torch.manual_seed(0)
        lin1, lin2 = nn.Linear(256, 512), nn.Linear(512, 256)
        with torch.no_grad():
            lin2.bias.add_(1.0)  # a bias added twice would show
        seq = nn.Sequential(*(Fp8BlockLinear.from_linear(lin, gran, torch.float8_e4m3fn, backend="reference")
                              for lin in (lin1, lin2)))
        seq.insert(1, nn.ReLU())
        x = torch.randn(3, 5, 256)
        with torch.no_grad():
            ref = seq(x)
            parallelize_module(seq, mesh, {"0": Fp8ColwiseParallel(), "2": Fp8RowwiseParallel()})
            got = seq(x)
        out[gran] = [float((got - ref).abs().max()), float(ref.abs().max())]
    return out


def _worker(cases: list[dict], out_dir: Path) -> None:
    import safetensors
    import torch.distributed as dist

    from fp8linear.integrations import tensor_parallel as tpm
    from fp8linear.integrations.transformers import from_pretrained

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    results = {}
    results["layers"] = _layers_case()
    for case in cases:
        dtype = getattr(torch, case["dtype"])
        if case["route"] in ("load", "official"):  # sharded loading: only this rank's slices are read
            safetensors._safe_open_orig = safetensors.safe_open
            safetensors.safe_open = _CountingOpen
            _CountingOpen.whole, _CountingOpen.sliced, _CountingOpen.full = {}, {}, {}
            try:
                folder = case["path"] + ("_official" if case["route"] == "official" else "")
                model = from_pretrained(folder, dtype=dtype, backend="reference", tp_plan="auto")
            finally:
                safetensors.safe_open = safetensors._safe_open_orig
            reads = {"whole": dict(_CountingOpen.whole), "sliced": dict(_CountingOpen.sliced),
                     "full": dict(_CountingOpen.full)}
        elif case["route"] == "hf":  # transformers' loader and styles, quantizing a bf16 checkpoint as it loads
            from transformers import AutoModelForCausalLM

            from fp8linear.integrations.transformers import Fp8LinearConfig

            model = AutoModelForCausalLM.from_pretrained(
                case["path"] + "_bf16", dtype=dtype, tp_plan="auto",
                quantization_config=Fp8LinearConfig(granularity="block", fp8_dtype="e4m3fn", backend="reference"),
            )
            reads = None
        else:  # every rank loads the whole model, then parallelize() keeps its slices
            model = from_pretrained(case["path"], dtype=dtype, backend="reference")
            tpm.parallelize(model)
            reads = None
        local, full = sharded_bytes(model)
        res = run_model(model)
        res.update(local_bytes=local, full_bytes=full, reads=reads)
        results[case["name"]] = res
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def _gpu_worker(cases: list[dict], out_dir: Path) -> None:
    """One GPU per rank, NCCL, the default backend (our kernels): each case loaded with tp_plan."""
    import torch.distributed as dist

    from fp8linear.integrations.transformers import from_pretrained

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    results = {}
    for case in cases:
        model = from_pretrained(case["path"], dtype=getattr(torch, case["dtype"]), tp_plan="auto")
        results[case["name"]] = run_model(model)
        del model
    (out_dir / f"rank{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    worker = _gpu_worker if sys.argv[3:] == ["gpu"] else _worker
    worker(json.loads(Path(sys.argv[1]).read_text()), Path(sys.argv[2]))
    sys.exit(0)


# ----------------------------------------------------------------------------- tests
def _torchrun(cases: list[dict], tmp: Path, nproc: int = 2, gpu: bool = False) -> list[dict]:
    spec = tmp / "cases.json"
    spec.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=str(Path(__file__).resolve().parents[2]) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if gpu:  # NVLink multicast off: NCCL's NVLS can take a shared host's GPUs out of service
        env.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
    else:  # the CPU (gloo) workers see no GPU, as on a CPU host: transformers' TP would take the GPUs
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           __file__, str(spec), str(tmp)] + (["gpu"] if gpu else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:  # the first worker traceback, then torchrun's summary
        first = proc.stderr.find("Traceback")
        raise AssertionError(f"torchrun failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n"
                             f"{proc.stderr[max(first, 0):][:6000]}\n...\n{proc.stderr[-2000:]}")
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(nproc)]


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    from fp8linear.integrations.transformers import from_pretrained

    tmp = tmp_path_factory.mktemp("tp")
    cases, refs = [], {}
    for kind in KINDS:
        path = write_case(tmp, kind)
        for dtype in ("float32", "bfloat16"):
            ref = run_model(from_pretrained(path, dtype=getattr(torch, dtype), backend="reference"))
            for name in CASE_NAMES:
                if name.startswith(f"{kind}-{dtype}-"):
                    cases.append({"name": name, "path": str(path), "dtype": dtype, "route": name.split("-")[-1]})
                    refs[name] = ref
    return refs, _torchrun(cases, tmp)


# (model, activation dtype, route): float32 checks every route exactly; bfloat16 the sharded loader.
# "official": the DeepSeek-V3 checkpoint layout with one tensor per expert.
CASE_NAMES = [f"{k}-float32-{r}" for k in KINDS for r in ("parallelize", "load", "hf")] + [
    f"{k}-bfloat16-load" for k in KINDS
] + ["deepseek_v3-float32-official"]


def _position_diffs(a: list, b: list) -> torch.Tensor:
    """Max |difference| of each (sequence, position)'s logits."""
    return (torch.tensor(a) - torch.tensor(b)).abs().amax(-1).flatten()


# float32 TP against one process. A rowwise layer's K halves are two fp32 partial sums under TP and
# one sum in one process, so a last bit may differ; where an activation sits on an FP8 rounding
# boundary, one value then rounds the other way (by 1/16 of itself), and the random tiny models carry
# that to the later positions of its sequence (Llama, seed 2 on torch 2.13 and seed 0 on torch 2.11:
# 5 of 24 positions moved, by up to 0.8% of the logit range; the rest agreed to 8e-7). A wrong shard
# moves every position, by up to the whole range. So: at least a quarter of the positions within
# 1e-5 of the range, none beyond FLIP_REACH of it, greedy tokens identical.
EXACT_SHARE = 0.25
FLIP_REACH = 0.05


def _assert_float32_match(label: str, got: dict, ref: dict) -> None:
    scale = float(torch.tensor(ref["logits"]).abs().max())
    diffs = _position_diffs(got["logits"], ref["logits"])
    exact = float(diffs.quantile(EXACT_SHARE))
    assert exact <= 1e-5 * scale, (f"{label}: logit differences at the {EXACT_SHARE:.0%} quantile of positions "
                                   f"{exact:.3g} > {1e-5 * scale:.3g} (1e-5 of the range)")
    assert float(diffs.max()) <= FLIP_REACH * scale, (f"{label}: max logit difference {float(diffs.max()):.3g} > "
                                                      f"{FLIP_REACH * scale:.3g} ({FLIP_REACH} of the range)")
    assert got["tokens"] == ref["tokens"], f"{label}: greedy tokens differ"


@pytest.mark.parametrize("name", CASE_NAMES)
def test_tp2_logits_tokens_bytes(tp_results, name):
    refs, ranks = tp_results
    ref = refs[name]
    if "bfloat16" in name:
        # The single-process model's own bf16 rounding error: its bf16 logits against the same
        # FP8 weights run with float32 activations, per position. TP (two roundings of each
        # rowwise output where one process has one) must stay within it at the median position;
        # the largest positions are not compared, as a bf16 perturbation can flip a MoE routing choice.
        floor = _position_diffs(ref["logits"], refs[name.replace("bfloat16", "float32")]["logits"])
    for rank, res in enumerate(ranks):
        got = res[name]
        if "float32" in name:
            _assert_float32_match(f"{name} rank {rank}", got, ref)
        else:
            diffs = _position_diffs(got["logits"], ref["logits"])
            assert float(diffs.median()) <= float(floor.median()), (
                f"{name} rank {rank}: median logit difference {float(diffs.median()):.3g} exceeds the model's own "
                f"bf16 rounding error {float(floor.median()):.3g}"
            )
        # Each rank holds half of every sharded tensor, plus whole per-tensor/replicated scales and biases.
        assert got["full_bytes"] > 0
        ratio = got["local_bytes"] / got["full_bytes"]
        assert 0.5 <= ratio < 0.52, f"{name} rank {rank}: holds {ratio:.3f} of the sharded layers' bytes"


@pytest.mark.parametrize("kind,route", [(k, "bfloat16-load") for k in KINDS] + [("deepseek_v3", "float32-official")])
def test_tp2_loading_reads_only_rank_slices(tp_results, kind, route):
    _, ranks = tp_results
    name = f"{kind}-{route}"
    reads = [res[name]["reads"] for res in ranks]
    sliced = reads[0]["sliced"]
    assert sliced, "no tensor was read through get_slice"
    assert any(".experts." in t for t in sliced) == (kind == "deepseek_v3")
    for rank, r in enumerate(reads):
        assert r["sliced"].keys() == sliced.keys()
        for tname, got in r["sliced"].items():
            assert tname not in r["whole"], f"rank {rank} read sharded tensor {tname} whole"
            # Each rank reads exactly half of every sharded tensor (the two halves: the whole tensor once).
            assert 2 * got == r["full"][tname], f"rank {rank} read {got} of {r['full'][tname]} bytes of {tname}"


# ----------------------------------------------------------------------------- plan-memory
# DeepSeek-V3's published config.json (deepseek-ai/DeepSeek-V3), the values that size the model.
DEEPSEEK_V3_CONFIG = {
    "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
    "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_nextn_predict_layers": 1,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "max_position_embeddings": 163840, "tie_word_embeddings": False,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip


def _deepseek_v3_params(c: dict) -> int:
    """DeepSeek-V3's parameter count from its config by hand (main model, no MTP module)."""
    h, heads, layers, dense = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"], c["first_k_dense_replace"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    attn = (h * c["q_lora_rank"] + c["q_lora_rank"] + c["q_lora_rank"] * heads * qk
            + h * (c["kv_lora_rank"] + c["qk_rope_head_dim"]) + c["kv_lora_rank"]
            + c["kv_lora_rank"] * heads * (c["qk_nope_head_dim"] + c["v_head_dim"]) + heads * c["v_head_dim"] * h)
    mlp = 3 * h * c["intermediate_size"]
    moe = (h * c["n_routed_experts"] + 3 * c["n_routed_experts"] * h * c["moe_intermediate_size"]
           + 3 * h * c["moe_intermediate_size"] * c["n_shared_experts"])
    per_layer_norms = 2 * h
    return (2 * c["vocab_size"] * h + h + layers * (attn + per_layer_norms)
            + dense * mlp + (layers - dense) * moe)  # fmt: skip


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory):
    from fp8linear.tools.plan_memory import _meta_fp8_model, load_config

    path = tmp_path_factory.mktemp("dsv3") / "config.json"
    path.write_text(json.dumps(DEEPSEEK_V3_CONFIG))
    config = load_config(path)
    return path, config, _meta_fp8_model(config, "block")


def test_plan_memory_deepseek_v3_parameters_and_sharding(dsv3):
    from fp8linear.tools.plan_memory import plan_memory

    _, config, model = dsv3
    one = plan_memory(config, 1, "block", model=model)
    assert one.param_count == _deepseek_v3_params(DEEPSEEK_V3_CONFIG)
    assert abs(one.param_count / 671e9 - 1) < 0.005, one.param_count  # DeepSeek's published 671 B
    assert one.fp8_sharded == 0
    for tp in (8, 16):
        p = plan_memory(config, tp, "block", model=model)
        # The sharded FP8 bytes split exactly; what stays whole is the MLA attention.
        assert p.fp8_sharded * tp + p.fp8_replicated == one.fp8_replicated
        assert p.fp8_replicated > 0
        assert p.scales < one.scales and p.high_precision < one.high_precision  # lm_head is sharded
        assert p.sharded_layers == {"colwise": 2 * 3 + 2 * 58 + 1, "rowwise": 3 + 58, "experts": 58}
        assert p.kv_bytes_per_token == one.kv_bytes_per_token  # attention replicated by the plan
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.gate_proj.*tp=32"):
        plan_memory(config, 32, "block", model=model)


def test_plan_memory_cli(dsv3, capsys):
    from fp8linear.cli import main

    path, _, _ = dsv3
    assert main(["plan-memory", str(path), "--tp", "8", "16", "32", "--context", "1024"]) == 0
    out = capsys.readouterr().out
    assert "671.03 B parameters" in out and "tp=8" in out and "tp=16" in out
    assert "tp=32: cannot shard" in out
    with pytest.raises(ValueError, match="config.json"):
        main(["plan-memory", str(path.parent / "missing.json")])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("kind", KINDS)
def test_tp2_on_two_gpus_matches_one_gpu(tmp_path, kind):
    """tp=2 over NCCL on two GPUs with the default backend (our kernels, the same routes a user
    gets) against the same FP8 model on one GPU, float32 activations, the CPU test's criterion
    (:func:`_assert_float32_match`). Summation order separates them (the rowwise K halves; the
    halved local shapes may also route to other kernels), and a last-bit difference that flips an
    FP8 activation rounding moves the later positions of its sequence (2x H200: passed with every
    position within 1e-5 of the range), where a sharding mistake moves every position by O(1)."""
    from fp8linear.integrations.transformers import from_pretrained

    path = write_case(tmp_path, kind)
    ref = run_model(from_pretrained(path, dtype=torch.float32, device_map="cuda:0"))
    case = {"name": kind, "path": str(path), "dtype": "float32"}
    for rank, res in enumerate(_torchrun([case], tmp_path, gpu=True)):
        _assert_float32_match(f"{kind} rank {rank}", res[kind], ref)


def test_tp2_torch_parallelize_module_layers(tp_results):
    """Fp8ColwiseParallel + Fp8RowwiseParallel with biases, every granularity, float32: same as one process."""
    _, ranks = tp_results
    for rank, res in enumerate(ranks):
        for gran, (diff, scale) in res["layers"].items():
            assert diff <= 1e-5 * scale, f"rank {rank} {gran}: max difference {diff:.3g} (outputs up to {scale:.3g})"


def test_param_shard_take():
    from fp8linear.integrations.tensor_parallel import ParamShard

    t = torch.arange(2 * 8 * 3).reshape(2, 8, 3)
    packed = ParamShard("packed", 1)
    assert torch.equal(packed.take(t, tuple(t.shape), 1, 2), torch.cat([t[:, 2:4], t[:, 6:8]], dim=1))
    assert packed.local_shape((2, 8, 3), 2) == (2, 4, 3)
    assert torch.equal(ParamShard("shard", 2).take(t, tuple(t.shape), 0, 3), t[:, :, :1])
    assert ParamShard("replicate").take(t, tuple(t.shape), 1, 2) is t


def test_unshardable_layers_are_refused():
    from fp8linear import Fp8BlockLinear
    from fp8linear.integrations.tensor_parallel import check_shardable

    layer = Fp8BlockLinear(256, 384, device="meta", fp8_dtype=torch.float8_e4m3fn)  # 3 blocks of N
    with pytest.raises(ValueError, match=r"'mlp\.up' over tp=2: its out_features \(384\)"):
        check_shardable("mlp.up", layer, "colwise", 2)
    check_shardable("mlp.up", layer, "colwise", 3)  # one block each
    row = Fp8BlockLinear(256, 384, granularity="row", device="meta", fp8_dtype=torch.float8_e4m3fn)
    check_shardable("mlp.up", row, "colwise", 2)  # row scales split per output row
    with pytest.raises(ValueError, match=r"in_features \(256\).*4 x 128 = 512"):
        check_shardable("mlp.down", layer, "rowwise", 4)
    with pytest.raises(ValueError, match="tp must be a positive int"):
        check_shardable("x", layer, "colwise", 0)


def test_resolve_tp_plan_styles():
    from fp8linear import Fp8BlockLinear
    from fp8linear.integrations.tensor_parallel import resolve_tp_plan

    def lin(k, n):
        return Fp8BlockLinear(k, n, device="meta", fp8_dtype=torch.float8_e4m3fn)

    model = nn.ModuleDict({"layers": nn.ModuleList(
        nn.ModuleDict({"up": lin(256, 512), "down": lin(512, 256), "norm": nn.LayerNorm(256)}) for _ in range(2)
    )})
    plan = {"layers.*.up": "colwise", "layers.*.down": "rowwise", "layers.*.norm": "replicate"}
    assert resolve_tp_plan(model, plan) == {
        "layers.0.up": "colwise", "layers.0.down": "rowwise", "layers.1.up": "colwise", "layers.1.down": "rowwise",
    }
    assert resolve_tp_plan(model, {"layers.*.up": "colwise_rep", "layers.*.down": "rowwise_split_input"})[
        "layers.1.down"] == "rowwise_rep"
    with pytest.raises(ValueError, match=r"'sequence_parallel' \(for 'layers\.0\.norm'\)"):
        resolve_tp_plan(model, {"layers.*.norm": "sequence_parallel"})
    with pytest.raises(ValueError, match=r"expected a linear layer, got LayerNorm"):
        resolve_tp_plan(model, {"layers.*.norm": "colwise"})
    with pytest.raises(ValueError, match="expected an Fp8Experts module"):
        resolve_tp_plan(model, {"layers.*.up": "moe_tp_experts"})
    with pytest.raises(ValueError, match="has none"):
        resolve_tp_plan(model, "auto")
    with pytest.raises(TypeError, match="tp_plan must be 'auto' or a dict"):
        resolve_tp_plan(model, ["colwise"])


def test_tp_wrapped_modules_are_freed_when_deleted(tmp_path):
    """The TP forwards reach their module through a weak reference: deleting a parallelized model
    frees its shards at once, without Python's cyclic garbage collector (one process, gloo, a mesh
    of one; the output is the unwrapped module's)."""
    import copy
    import weakref

    import torch.distributed as dist
    from _utils import without_cyclic_gc
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    from fp8linear import Fp8BlockLinear, quantize_weight
    from fp8linear.integrations.experts import Fp8Experts
    from fp8linear.integrations.tensor_parallel import Fp8ColwiseParallel, Fp8ExpertsParallel, Fp8RowwiseParallel

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        seq = nn.Sequential(Fp8BlockLinear.from_linear(nn.Linear(256, 512)), nn.ReLU(),
                            Fp8BlockLinear.from_linear(nn.Linear(512, 256)))
        experts = Fp8Experts(4, 256, 256, act_fn=nn.SiLU())
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                q, scale = quantize_weight(torch.randn(getattr(experts, name).shape) * 0.05, "block")
                getattr(experts, name).copy_(q)
                getattr(experts, f"{name}_scale_inv").copy_(scale)
        x, idx, w = torch.randn(3, 256), torch.tensor([[0, 1], [2, 3], [1, 2]]), torch.full((3, 2), 0.5)
        with torch.no_grad():
            ref_seq, ref_experts = seq(x), experts(x, idx, w)
        mesh = init_device_mesh("cpu", (1,))
        parallelize_module(seq, mesh, {"0": Fp8ColwiseParallel(), "2": Fp8RowwiseParallel()})
        parallelize_module(experts, mesh, Fp8ExpertsParallel())
        with without_cyclic_gc():
            with torch.no_grad():
                for _ in range(2):
                    assert torch.equal(seq(x), ref_seq)
                    assert torch.equal(experts(x, idx, w), ref_experts)
            refs = [weakref.ref(m) for m in (seq[0], seq[2], experts)]
            refs += [weakref.ref(seq[0].weight), weakref.ref(experts.down_proj)]
            del seq, experts
            assert all(r() is None for r in refs)
        # a copy keeps the original's forward function: once the original is gone it says so
        layer = Fp8BlockLinear.from_linear(nn.Linear(256, 512))
        parallelize_module(layer, mesh, Fp8ColwiseParallel())
        twin = copy.deepcopy(layer)
        del layer
        with pytest.raises(RuntimeError, match="no longer exists"):
            twin(x)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_quantizer_marks_tp_modules_where_transformers_has_no_plan_hook(kind, monkeypatch):
    """transformers 5.17 has no ``HfQuantizer.update_parallel_plan``: its TP styles read
    ``_hf_quantized_needs_local_tp`` from each module when it runs, and without the mark they ran
    our modules on DTensor parameters (the hf route's logits 1.3-1.6 off at tp=2 there). Before
    loading a model asked for tensor parallelism (5.17 puts ``distributed_config`` on the config
    first) the quantizer marks the planned fp8linear modules itself, and refuses per-tensor scales
    with a clear error (5.17 failed inside DTensor: "Expected tensor.dim() > 0")."""
    from types import SimpleNamespace

    from fp8linear.integrations import hf_quantizer
    from fp8linear.integrations.tensor_parallel import _wildcard
    from fp8linear.integrations.transformers import Fp8LinearConfig

    monkeypatch.setattr(hf_quantizer, "_HAS_PARALLEL_PLAN_HOOK", False)

    def prepared(tp_size, granularity="block"):
        model = make_model(kind)
        if tp_size:
            model.config.distributed_config = SimpleNamespace(tp_size=tp_size, enable_expert_parallel=False)
        config = Fp8LinearConfig(granularity=granularity, fp8_dtype="e4m3fn")
        hf_quantizer.Fp8LinearHfQuantizer(config)._process_model_before_weight_loading(model)
        return model

    for model in (prepared(None), prepared(1)):  # one process: nothing to mark
        assert not any(getattr(m, "_hf_quantized_needs_local_tp", False) for m in model.modules())
    model = prepared(2)
    fp8 = {name: m for name, m in model.named_modules()
           if hasattr(m, "weight_scale_inv") or hasattr(m, "down_proj_scale_inv")}
    planned = [m for name, m in fp8.items() if _wildcard(name) in model.tp_plan]
    assert planned and all(getattr(m, "_hf_quantized_needs_local_tp", False) for m in planned)
    with pytest.raises(ValueError, match="per-tensor scales cannot be computed while loading under tp_plan"):
        prepared(2, "tensor")
