"""Accuracy study of FP8 on SmolLM2-135M (docs/accuracy.md): error sources, per window, with paired statistics.

Fake-quantized fp32 model: every linear layer but lm_head computes F.linear(fq(x), dequant(quant(w))) in fp32,
which is bit-identical to Fp8BlockLinear's reference path on an fp32 model (checked: max |logit diff| = 0).
All configs share one model and are run on the same windows as the unquantized fp32 baseline, so per-window
differences are paired. Writes one JSON line per window (nll sum, KL(base||cfg), argmax agreement per config).

    python examples/accuracy_study.py --configs "wa:row;wa:block;w:row;a;wa:row:-down_proj" \
        --windows 0,1,2,3,101 --out study.jsonl

Config syntax: MODE[:GRAN[:SEL]] with MODE w (weights), a (activations) or wa (both); GRAN block/row/tensor,
or rowperm/blockperm (FP8 errors permuted within rows), noise (Gaussian, FP8 row-wise error rms),
rowjitN/blockjitN (scale = amax*u/448, u ~ U[1, 1.125) per group, seed N: an equivalent FP8 rounding draw);
SEL +type,type (only these layer types) or -type,type (all but these), types q_proj ... down_proj.
"""
import torch, json, sys, time, argparse
import torch.nn.functional as F
from torch import nn
from pathlib import Path
from transformers import AutoModelForCausalLM
from fp8linear import quantize_weight, dequantize_weight
from fp8linear.reference import quantize_activation_ref, dequantize_activation_ref
torch.set_num_threads(2)
STATE = {"w": None, "a": False, "types": None}
from fp8linear.reference import round_to_fp8_grid
def jitter_quant(w, gran, seed):
    n, k = w.shape
    gen = torch.Generator().manual_seed(seed * 1000003 + n * 7 + k)
    kp = -(-k // 128) * 128; np_ = -(-n // 128) * 128
    wp = torch.zeros(np_, kp); wp[:n, :k] = w
    if gran == "row":
        g = wp.reshape(np_, kp // 128, 128); dims = (-1,)
    else:
        g = wp.reshape(np_ // 128, 128, kp // 128, 128); dims = (1, 3)
    amax = g.abs().amax(dim=dims, keepdim=True).clamp(min=1e-12)
    u = 1 + 0.125 * torch.rand(amax.shape, generator=gen)
    scale = amax * u / 448.0
    q = round_to_fp8_grid((g / scale).clamp(-448, 448).contiguous(), torch.float8_e4m3fn)
    return (q * scale).reshape(np_, kp)[:n, :k].contiguous()
class FQ(nn.Module):
    def __init__(self, lin, typ, grans):
        super().__init__()
        self.typ = typ
        w = lin.weight.detach()
        self.ws = {"base": w.float()}
        for g in grans:
            if g.endswith("perm"):  # same FP8 errors, randomly permuted within each row
                base_g = g[:-4]
                e = dequantize_weight(*quantize_weight(w, base_g)) - w.float()
                gen = torch.Generator().manual_seed(0)
                idx = torch.argsort(torch.rand(e.shape, generator=gen), dim=1)
                self.ws[g] = w.float() + e.gather(1, idx)
            elif "jit" in g:  # e.g. rowjit1: same granularity, scale = amax*u/448 with u~U[1,1.125) per group, seed 1
                base_g, seed = g.split("jit")
                self.ws[g] = jitter_quant(w.float(), base_g, int(seed))
            elif g.startswith("noise"):  # gaussian noise with the same per-row error rms as FP8 row-wise
                e = dequantize_weight(*quantize_weight(w, "row")) - w.float()
                gen = torch.Generator().manual_seed(0)
                self.ws[g] = w.float() + torch.randn(e.shape, generator=gen) * e.pow(2).mean(1, keepdim=True).sqrt()
            else:
                self.ws[g] = dequantize_weight(*quantize_weight(w, g))
    def forward(self, x):
        on = STATE["types"] is None or self.typ in STATE["types"]
        w = self.ws[STATE["w"]] if (on and STATE["w"]) else self.ws["base"]
        if on and STATE["a"]:
            x = dequantize_activation_ref(*quantize_activation_ref(x, torch.float8_e4m3fn))
        return F.linear(x, w)
def parse(cfg):  # e.g. "wa:row", "w:block", "a", "wa:row:-down_proj", "wa:row:+down_proj"
    parts = cfg.split(":")
    mode = parts[0]; gran = parts[1] if len(parts) > 1 and parts[1] else None
    types = None
    if len(parts) > 2:
        sel = parts[2]
        allt = {"q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"}
        names = set(sel[1:].split(","))
        types = names if sel[0] == "+" else allt - names
    return dict(w=gran if "w" in mode else None, a="a" in mode, types=types)
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", required=True)
    ap.add_argument("--windows", required=True)  # comma list
    ap.add_argument("--out", required=True)
    ap.add_argument("--bs", type=int, default=2)
    a = ap.parse_args()
    configs = a.configs.split(";")
    from fp8linear.tools.smollm2 import smollm2_checkpoint
    p = smollm2_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32).eval()
    grans = sorted({parse(c)["w"] for c in configs if parse(c)["w"]})
    for name, mod in list(model.named_modules()):
        if isinstance(mod, nn.Linear) and not name.endswith("lm_head"):
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, FQ(mod, child, grans))
    from transformers import AutoTokenizer
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from perplexity import default_text, read_text
    ids = torch.tensor(AutoTokenizer.from_pretrained(p)(read_text(default_text()))["input_ids"], dtype=torch.long)
    wins = [int(w) for w in a.windows.split(",")]
    out = Path(a.out); done = set()
    if out.exists():
        done = {json.loads(l)["win"] for l in out.open()}
    t0 = time.time()
    for i in range(0, len(wins), a.bs):
        ws = [w for w in wins[i:i+a.bs] if w not in done]
        if not ws: continue
        x = torch.stack([ids[w*512:(w+1)*512] for w in ws])
        tgt = x[:, 1:]
        rec = {w: {"win": w} for w in ws}
        with torch.no_grad():
            STATE.update(w=None, a=False, types=None)
            lb = model(x).logits[:, :-1].float().log_softmax(-1)
            pb = lb.argmax(-1)
            nllb = -lb.gather(-1, tgt[..., None])[..., 0]
            for j, w in enumerate(ws): rec[w]["base"] = {"nll": nllb[j].sum().item()}
            for c in configs:
                STATE.update(parse(c))
                lc = model(x).logits[:, :-1].float().log_softmax(-1)
                nll = -lc.gather(-1, tgt[..., None])[..., 0]
                kl = (lb.exp() * (lb - lc)).sum(-1)
                agree = (lc.argmax(-1) == pb)
                for j, w in enumerate(ws):
                    rec[w][c] = {"nll": nll[j].sum().item(), "kl": kl[j].mean().item(), "agree": int(agree[j].sum()), "n": tgt.shape[1]}
                del lc
        with out.open("a") as f:
            for w in ws: f.write(json.dumps(rec[w]) + "\n")
        print(f"windows {i+len(ws)}/{len(wins)} {time.time()-t0:.0f}s", flush=True)
if __name__ == "__main__":
    main()
