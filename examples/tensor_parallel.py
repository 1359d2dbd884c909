"""Tensor-parallel FP8 inference with torchrun: a DeepSeek-V3-architecture model at tp=1 and tp=N.

    torchrun --nproc-per-node 2 examples/tensor_parallel.py                    # CPU (gloo), tiny model
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 examples/tensor_parallel.py --preset v3 --layers 4
    torchrun --nproc-per-node 2 examples/tensor_parallel.py --checkpoint /path/to/fp8_checkpoint

Steps: rank 0 builds a random model of the preset's widths, quantizes it to FP8 and saves it
(or `--checkpoint` names an FP8 checkpoint folder); rank 0 alone loads it whole and measures the
tp=1 reference (logits, prefill and decode tokens/s, memory); then every rank loads it with
``from_pretrained(path, tp_plan="auto")`` (each rank reads only its slices), runs the same
prompt and rank 0 prints the logit difference, whether greedy tokens match, tokens/s and the
memory of every rank. On GPUs each rank uses cuda:LOCAL_RANK and NCCL; on CPU, gloo.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from fp8linear.integrations.transformers import from_pretrained, quantize_model_, save_pretrained

# Widths that split on 128 boundaries at tp=2 (v3: DeepSeek-V3's own layer widths, 32 routed
# experts instead of 256 so that the tp=1 reference fits one GPU).
PRESETS = {
    "v3": dict(hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, n_routed_experts=32,
               num_experts_per_tok=8, n_shared_experts=1, n_group=8, topk_group=4, num_attention_heads=128,
               q_lora_rank=1536, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128),
    "tiny": dict(hidden_size=256, intermediate_size=512, moe_intermediate_size=256, n_routed_experts=8,
                 num_experts_per_tok=2, n_shared_experts=1, n_group=4, topk_group=2, num_attention_heads=2,
                 q_lora_rank=256, kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=64),
}


def log(*args) -> None:
    if dist.get_rank() == 0:
        print(*args, flush=True)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def write_checkpoint(preset: str, layers: int, path: Path, device: torch.device) -> None:
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    p = PRESETS[preset]
    config = DeepseekV3Config(vocab_size=32000, num_hidden_layers=layers, first_k_dense_replace=1,
                              num_key_value_heads=p["num_attention_heads"], max_position_embeddings=4096,
                              tie_word_embeddings=False, **p)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    quantize_model_(model, granularity="block")
    save_pretrained(model, path)


@torch.no_grad()
def measure(model, prompt: torch.Tensor, new_tokens: int, repeats: int) -> dict:
    """Logits of the prompt, greedy tokens, prefill and decode tokens/s (medians of `repeats`)."""
    dev = prompt.device
    kw = dict(do_sample=False, pad_token_id=0)
    logits = model(prompt).logits.float()
    tokens = model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
    model.generate(prompt, max_new_tokens=1, **kw)  # warm-up

    def timed(n: int) -> float:
        sync(dev)
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=n, min_new_tokens=n, **kw)
        sync(dev)
        return time.perf_counter() - t0

    prefill = statistics.median(timed(1) for _ in range(repeats))
    full = statistics.median(timed(new_tokens) for _ in range(repeats))
    b, t = prompt.shape
    return {"logits": logits.cpu(), "tokens": tokens[:, t:].cpu(), "prefill_tok_s": b * t / prefill,
            "decode_tok_s": b * (new_tokens - 1) / max(full - prefill, 1e-9)}


@torch.no_grad()
def sensitivity(model, prompt: torch.Tensor, logits: torch.Tensor) -> float:
    """Max |logit change| of the model when its input embeddings move by about one unit in the
    last place of their dtype (relative noise of the dtype's epsilon, seeded): the size of
    difference that rounding and summation order alone can cause. FP8 activation quantization
    rounds to 1/8 steps, so a last-bit change that crosses a rounding boundary moves a value by up
    to 6%, and random-weight models amplify that from layer to layer."""
    g = torch.Generator(device=prompt.device).manual_seed(3)

    def perturb(module, args, out):
        noise = torch.randn(out.shape, generator=g, device=out.device, dtype=torch.float32)
        return (out.float() * (1 + torch.finfo(out.dtype).eps * noise)).to(out.dtype)

    handle = model.get_input_embeddings().register_forward_hook(perturb)
    try:
        moved = model(prompt).logits.float().cpu()
    finally:
        handle.remove()
    return float((moved - logits).abs().max())


def memory_gib(model, device: torch.device) -> float:
    """GPU: peak allocated on this rank; CPU: bytes of this rank's parameters and buffers."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    from torch.distributed.tensor import DTensor

    tensors = list(model.parameters()) + list(model.buffers())
    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default=None, help="default: v3 on GPUs, tiny on CPU")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--checkpoint", type=Path, default=None, help="an FP8 checkpoint folder (else one is made)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                        help="activations and non-FP8 weights (float32: TP equals tp=1 up to summation order)")
    parser.add_argument("--no-reference", action="store_true", help="skip the tp=1 run (models too big for one device)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rank, tp = dist.get_rank(), dist.get_world_size()
    preset = args.preset or ("v3" if cuda else "tiny")
    dtype = getattr(torch, args.dtype)

    tmp = None
    path = args.checkpoint
    if path is None:
        tmp = tempfile.mkdtemp(prefix="fp8linear_tp_") if rank == 0 else None
        holder = [tmp]
        dist.broadcast_object_list(holder, src=0)
        path = Path(holder[0])
        if rank == 0:
            log(f"writing a random {preset} model ({args.layers} layers) in FP8 to {path}")
            write_checkpoint(preset, args.layers, path, device)
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
    dist.barrier()

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 32000, (args.batch, args.prompt_len), generator=g).to(device)

    ref = None
    if not args.no_reference:
        if rank == 0:
            model = from_pretrained(path, device_map=device, dtype=dtype)
            ref = measure(model, prompt, args.new_tokens, args.repeats)
            ref["mem"] = memory_gib(model, device)
            ref["sensitivity"] = sensitivity(model, prompt, ref["logits"])
            del model
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
        dist.barrier()

    model = from_pretrained(path, tp_plan="auto", dtype=dtype)
    res = measure(model, prompt, args.new_tokens, args.repeats)
    mems = [None] * tp
    dist.all_gather_object(mems, memory_gib(model, device))

    kind = "peak GPU memory" if cuda else "weights held"
    log(f"\npreset {preset}, {args.layers} layers, {args.dtype}, batch {args.batch}, prompt {args.prompt_len}, "
        f"{args.new_tokens} new tokens, {'NCCL' if cuda else 'gloo'}")
    log(f"{'':8}{'prefill tok/s':>15}{'decode tok/s':>15}  {kind} per rank (GiB)")
    if ref is not None:
        log(f"{'tp=1':8}{ref['prefill_tok_s']:15.1f}{ref['decode_tok_s']:15.2f}  {ref['mem']:.2f}")
    log(f"{f'tp={tp}':8}{res['prefill_tok_s']:15.1f}{res['decode_tok_s']:15.2f}  "
        + ", ".join(f"{m:.2f}" for m in mems))
    if ref is not None:
        diff = float((res["logits"] - ref["logits"]).abs().max())
        scale = float(ref["logits"].abs().max())
        same = torch.equal(res["tokens"], ref["tokens"])
        log(f"max |logits tp={tp} - tp=1| = {diff:.4g} (logits up to {scale:.3g}); "
            f"greedy tokens {'identical' if same else 'differ'}")
        log(f"the tp=1 model's own max logit change when its embeddings move by one {args.dtype} ulp: "
            f"{ref['sensitivity']:.4g} (tp={tp} {'within' if diff <= ref['sensitivity'] else 'ABOVE'} that)")
    dist.barrier()
    if tmp is not None and rank == 0:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
