"""The main job's report (fp8linear.tools.evaluation.format_comparison): memory, agreement, then speed,
with the reason stated wherever FP8 is slower."""

import math

import pytest
import torch

from fp8linear.tools.evaluation import GenerationResult, format_comparison

MIB = 2**20


def _result(prefill_s: float, decode_s: float, text: str = "Paris") -> GenerationResult:
    return GenerationResult(texts=[text], sequences=torch.zeros(1, 4, dtype=torch.long),
                            attention_mask=torch.ones(1, 4, dtype=torch.long), prompt_tokens=20, new_tokens=11,
                            prefill_s=prefill_s, decode_s=decode_s)


def _report(bf16: GenerationResult, fp8: GenerationResult, device_type: str) -> list[str]:
    return format_comparison(["q"], bf16, fp8, 256 * MIB, 155 * MIB, (0.891, 101), device_type).splitlines()


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_report_leads_with_memory_and_agreement(device_type):
    lines = _report(_result(0.01, 0.2), _result(0.01, 0.2), device_type)
    assert lines[0].startswith("weight memory") and "0.61x, 101.0 MiB saved" in lines[0]
    assert lines[1].startswith("agreement") and "89.1%" in lines[1] and "1/1 generations identical" in lines[1]
    assert lines[2].startswith("speed")


@pytest.mark.parametrize("device_type, reason", [("cpu", "no FP8 matrix units"), ("cuda", "kernel launches")])
def test_slower_fp8_is_said_with_its_reason(device_type, reason):
    text = "\n".join(_report(_result(0.01, 0.2), _result(0.03, 0.9), device_type))
    assert "FP8 is slower at prefill and decode here." in text and reason in text
    assert "(0.33x)" in text and "(0.22x)" in text  # 2000 vs 667 tok/s prefill, 55 vs 12.2 decode
    assert "faster" not in text


def test_faster_fp8_is_said_without_excuse():
    text = "\n".join(_report(_result(0.01, 0.2), _result(0.008, 0.15), "cuda"))
    assert "FP8 is faster at prefill and decode here" in text and "slower" not in text


def test_unmeasurable_timings_are_not_reported_as_speeds():
    fp8 = _result(0.01, 0.0)  # decode time 0: the full generation took no longer than the prefill
    assert math.isinf(fp8.decode_tok_s)
    text = "\n".join(_report(_result(0.01, 0.2), fp8, "cpu"))
    assert "decode   not measured" in text and "inf" not in text
