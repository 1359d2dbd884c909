"""Side-by-side measurements of a BF16 and an FP8 model (used by the examples and the main job).

Generation speed (prefill and decode tokens/s), weight memory, teacher-forced next-token
agreement and perplexity over fixed-length windows. Timings synchronise the device.
"""

from __future__ import annotations

import math
import statistics
import textwrap
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import nn

__all__ = [
    "GenerationResult",
    "weight_bytes",
    "generate_timed",
    "generate_timed_together",
    "next_token_agreement",
    "perplexity",
    "WindowMetrics",
    "window_metrics",
    "format_comparison",
    "compare_generation",
]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def weight_bytes(model: nn.Module) -> int:
    """Bytes of all parameters and buffers, counting tied tensors once."""
    seen: set[int] = set()
    total = 0
    for t in list(model.parameters()) + list(model.buffers()):
        if t.data_ptr() in seen:
            continue
        seen.add(t.data_ptr())
        total += t.numel() * t.element_size()
    return total


@dataclass
class GenerationResult:
    """Greedy generations of one model and their timings."""

    texts: list[str]
    sequences: torch.Tensor  # (batch, prompt + new) token ids, on CPU
    attention_mask: torch.Tensor  # (batch, prompt + new), 0 on left padding, on CPU
    prompt_tokens: int
    new_tokens: int
    prefill_s: float
    decode_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.prefill_s < 0 or self.decode_s < 0:
            raise ValueError(f"timings must be >= 0, got prefill {self.prefill_s}, decode {self.decode_s}")

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s > 0 else math.inf

    @property
    def decode_tok_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else math.inf


class _TimedGenerator:
    """Greedy generation of one model on one left-padded batch, timed call by call."""

    def __init__(self, model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int,
                 **generate_kwargs: Any) -> None:
        if max_new_tokens < 2:
            raise ValueError(f"max_new_tokens must be >= 2 to time decoding, got {max_new_tokens}")
        self.model, self.tokenizer, self.max_new_tokens = model, tokenizer, max_new_tokens
        self.device = _device(model)
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        self.enc = tokenizer(list(prompts), return_tensors="pt", padding=True).to(self.device)
        self.kwargs = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id, **generate_kwargs)
        self.prefill: list[float] = []
        self.full: list[float] = []
        self.out: torch.Tensor | None = None

    def run(self, n_new: int) -> tuple[float, torch.Tensor]:
        _sync(self.device)
        t0 = time.perf_counter()
        out = self.model.generate(**self.enc, max_new_tokens=n_new, min_new_tokens=n_new, **self.kwargs)
        _sync(self.device)
        return time.perf_counter() - t0, out

    def sample(self) -> None:
        """One prefill (``max_new_tokens=1``) and one full generation, timed."""
        self.prefill.append(self.run(1)[0])
        t, self.out = self.run(self.max_new_tokens)
        self.full.append(t)

    def result(self) -> GenerationResult:
        """Medians of the samples; decode time is the median full generation minus the median prefill."""
        out, enc = self.out, self.enc
        n_prompt = enc["input_ids"].shape[1]
        prefill, total = statistics.median(self.prefill), statistics.median(self.full)
        return GenerationResult(
            texts=self.tokenizer.batch_decode(out[:, n_prompt:], skip_special_tokens=True), sequences=out.cpu(),
            attention_mask=torch.cat([enc["attention_mask"].cpu(), torch.ones_like(out[:, n_prompt:].cpu())], dim=1),
            prompt_tokens=int(enc["attention_mask"].sum()),
            new_tokens=out.shape[0] * (self.max_new_tokens - 1), prefill_s=prefill, decode_s=max(total - prefill, 0.0),
        )


@torch.no_grad()
def generate_timed(
    model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 32, warmup: bool = True,
    repeats: int = 3, **generate_kwargs: Any,
) -> GenerationResult:
    """Greedy-generate `max_new_tokens` for each prompt (one left-padded batch) and time it.

    Prefill time is the median over `repeats` calls of ``generate(max_new_tokens=1)``; decode time
    is the median full generation minus that, so decode tokens/s counts batch x (max_new_tokens - 1)
    tokens. `warmup` first runs one full generation untimed (first-call costs: kernel compilation,
    weight preparation, launch plans).
    """
    return generate_timed_together([model], tokenizer, prompts, max_new_tokens, warmup, repeats,
                                   **generate_kwargs)[0]


@torch.no_grad()
def generate_timed_together(
    models: Sequence[nn.Module], tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 32,
    warmup: bool = True, repeats: int = 3, **generate_kwargs: Any,
) -> list[GenerationResult]:
    """:func:`generate_timed` for several models, sampled in interleaved rounds (one sample of each
    model per round), so a machine that slows down during the run slows every model alike."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    gens = [_TimedGenerator(m, tokenizer, prompts, max_new_tokens, **generate_kwargs) for m in models]
    if warmup:
        for g in gens:
            g.run(max_new_tokens)
    for _ in range(repeats):
        for g in gens:
            g.sample()
    return [g.result() for g in gens]


@torch.no_grad()
def next_token_agreement(
    model_a: nn.Module, model_b: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
) -> tuple[float, int]:
    """Fraction of (unpadded) positions where both models' greedy next token agree, teacher-forced; and the count."""
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
    mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool().cpu()

    def predict(model: nn.Module) -> torch.Tensor:
        dev = _device(model)
        return model(input_ids.to(dev), attention_mask=mask.long().to(dev)).logits.argmax(-1).cpu()

    same = (predict(model_a) == predict(model_b))[mask]
    return same.float().mean().item(), same.numel()


@dataclass
class WindowMetrics:
    """Perplexity over fixed windows, with the greedy predictions (for agreement between models)."""

    perplexity: float
    tokens: int  # tokens scored
    predictions: torch.Tensor  # (windows, window - 1) argmax next tokens, on CPU

    def __post_init__(self) -> None:
        if self.tokens <= 0:
            raise ValueError(f"tokens must be > 0, got {self.tokens}")

    def agreement(self, other: "WindowMetrics") -> float:
        """Fraction of positions where both models predict the same next token."""
        if self.predictions.shape != other.predictions.shape:
            raise ValueError(f"prediction shapes differ: {tuple(self.predictions.shape)} vs {tuple(other.predictions.shape)}")
        return (self.predictions == other.predictions).float().mean().item()


@torch.no_grad()
def window_metrics(
    model: nn.Module, token_ids: torch.Tensor, window: int = 512, max_windows: int | None = None, batch_size: int = 4
) -> WindowMetrics:
    """Perplexity and greedy predictions over non-overlapping `window`-token windows of a 1-D token stream."""
    if token_ids.dim() != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tuple(token_ids.shape)}")
    n = token_ids.numel() // window
    if max_windows is not None:
        n = min(n, max_windows)
    if n == 0:
        raise ValueError(f"need at least {window} tokens, got {token_ids.numel()}")
    windows = token_ids[: n * window].view(n, window)
    device = _device(model)
    nll, count, preds = 0.0, 0, []
    for i in range(0, n, batch_size):
        x = windows[i : i + batch_size].to(device)
        logits = model(x).logits[:, :-1].float()
        target = x[:, 1:]
        nll += torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum").item()
        count += target.numel()
        preds.append(logits.argmax(-1).cpu())
    return WindowMetrics(math.exp(nll / count), count, torch.cat(preds))


def perplexity(
    model: nn.Module, token_ids: torch.Tensor, window: int = 512, max_windows: int | None = None, batch_size: int = 4
) -> tuple[float, int]:
    """Perplexity over non-overlapping `window`-token windows of a 1-D token stream; (ppl, tokens scored)."""
    m = window_metrics(model, token_ids, window, max_windows, batch_size)
    return m.perplexity, m.tokens


# Why FP8 can be slower than BF16, by device type: said next to a ratio below 1.
_SLOWER_BECAUSE = {
    "cpu": ("CPUs have no FP8 matrix units: each FP8 weight is decoded (in registers at decode sizes, to "
            "float16 or fp32 tiles above) before it is multiplied, while BF16 runs one native GEMM. On a CPU, "
            "FP8 saves memory, not time."),
    "cuda": ("At this model's size (hidden 576) eager generation is bound by kernel launches and host "
             "work, not by weight reads, so FP8's halved weight traffic cannot pay for its extra launches."),
}


def _speed_lines(bf16: GenerationResult, fp8: GenerationResult, device_type: str) -> list[str]:
    lines, slower, faster = [], [], []
    for what, b, f in (("prefill", bf16.prefill_tok_s, fp8.prefill_tok_s), ("decode", bf16.decode_tok_s, fp8.decode_tok_s)):
        if not (math.isfinite(b) and math.isfinite(f) and b > 0 and f > 0):
            lines.append(f"{what:8} not measured: the timings on this machine were too noisy to separate it")
            continue
        lines.append(f"{what:8} {f:9.1f} tok/s FP8 vs {b:9.1f} BF16 ({f / b:.2f}x)")
        (faster if f >= b else slower).append(what)
    if faster:
        lines.append(f"FP8 is faster at {' and '.join(faster)} here")
    if slower:
        reason = _SLOWER_BECAUSE.get(device_type, "")
        lines += textwrap.wrap(f"FP8 is slower at {' and '.join(slower)} here." + (f" {reason}" if reason else ""), 85)
    return lines


def format_comparison(
    prompts: Sequence[str], bf16: GenerationResult, fp8: GenerationResult, bf16_bytes: int, fp8_bytes: int,
    agreement: tuple[float, int] | None = None, device_type: str = "cpu",
) -> str:
    """A report that leads with what FP8 gives on this device: memory, agreement with BF16, speed
    (said plainly where it is slower, with the reason), then the generations side by side.

    `prompts` are only displayed (e.g. the user questions rather than the chat-templated text).
    """
    mib = 2**20
    same = sum(a == b for a, b in zip(bf16.texts, fp8.texts))
    lines = [
        f"weight memory  {fp8_bytes / mib:9.1f} MiB FP8 vs {bf16_bytes / mib:9.1f} MiB BF16 "
        f"({fp8_bytes / bf16_bytes:.2f}x, {(bf16_bytes - fp8_bytes) / mib:.1f} MiB saved)",
    ]
    if agreement is not None:
        lines.append(f"agreement      {agreement[0] * 100:.1f}% of next tokens equal to BF16's (teacher-forced, "
                     f"{agreement[1]} positions); {same}/{len(prompts)} generations identical")
    else:
        lines.append(f"agreement      {same}/{len(prompts)} generations identical to BF16's")
    speed = _speed_lines(bf16, fp8, device_type)
    lines += ["speed          " + speed[0]] + ["               " + line for line in speed[1:]]
    lines.append("")
    for i, p in enumerate(prompts):
        lines += [f"prompt {i}: {p!r}", f"  BF16: {bf16.texts[i]!r}", f"  FP8 : {fp8.texts[i]!r}"]
    return "\n".join(lines)


def compare_generation(
    bf16_model: nn.Module, fp8_model: nn.Module, tokenizer: Any, prompts: Sequence[str], max_new_tokens: int = 32,
    labels: Sequence[str] | None = None, **generate_kwargs: Any,
) -> str:
    """Generate with both models on the same prompts and return :func:`format_comparison`'s report.

    Next-token agreement is measured teacher-forced on the BF16 model's generated sequences.
    `labels` replace the prompts in the report (same length).
    """
    if labels is not None and len(labels) != len(prompts):
        raise ValueError(f"labels must have one entry per prompt ({len(prompts)}), got {len(labels)}")
    bf16, fp8 = generate_timed_together([bf16_model, fp8_model], tokenizer, prompts, max_new_tokens,
                                        **generate_kwargs)
    agree = next_token_agreement(bf16_model, fp8_model, bf16.sequences, bf16.attention_mask)
    return format_comparison(labels or prompts, bf16, fp8, weight_bytes(bf16_model), weight_bytes(fp8_model), agree,
                             device_type=_device(fp8_model).type)
