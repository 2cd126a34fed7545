"""Where the chunked loss's time goes (olmo-core-8l head: 16,384 tokens, d 4096, vocab 100,352), piece by piece.

    python3 packages/moe-train/bench/explore_chunked_loss.py

Times (CUDA events, median of 5 after a warm-up) each GEMM of a chunk with bf16 and fp32 outputs, the fp32
accumulation of the head weight's gradient (out-of-place add against addmm into the accumulator), and the softmax
chain three ways (the shipped ops, a softmax-based chain, and one torch.compile'd function), against the whole-logits
F.cross_entropy forward+backward. Prints one JSON line per measurement."""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F

N, D, V = 16384, 4096, 100_352


def timed(name: str, fn, **extra) -> float:
    fn()
    times = []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    ms = statistics.median(times)
    print(json.dumps({"what": name, "ms": round(ms, 3), **extra}), flush=True)
    return ms


def chain_shipped(logits_bf16, t, kept, inv):
    logits = logits_bf16.float()
    lse = torch.logsumexp(logits, 1)
    loss = torch.where(kept, lse - logits.gather(1, t[:, None]).squeeze(1), 0).sum()
    g = logits.sub_(lse[:, None]).exp_()
    g.scatter_add_(1, t[:, None], -kept.float()[:, None])
    g.mul_((kept.float() * inv)[:, None])
    return loss, g.to(torch.bfloat16)


def chain_softmax(logits_bf16, t, kept, inv):
    logits = logits_bf16.float()
    lse = torch.logsumexp(logits, 1)
    loss = torch.where(kept, lse - logits.gather(1, t[:, None]).squeeze(1), 0).sum()
    g = torch.softmax(logits, 1)
    g.scatter_add_(1, t[:, None], -kept.float()[:, None])
    scale = (kept.float() * inv)[:, None]
    return loss, torch.mul(g, scale).to(torch.bfloat16)


def main() -> None:
    torch.manual_seed(0)
    w = (torch.randn(V, D, device="cuda") * 0.02).to(torch.bfloat16)
    h = torch.randn(N, D, device="cuda").to(torch.bfloat16)
    t = torch.randint(0, V, (N,), device="cuda")
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}))
    whole = (h @ w.T).requires_grad_()
    timed("whole: logits GEMM", lambda: h @ w.T)
    timed("whole: F.cross_entropy fwd+bwd on bf16 logits (fp32 upcast)",
          lambda: F.cross_entropy(whole.float(), t).backward())
    timed("whole: grad_h GEMM", lambda: whole.detach() @ w)
    timed("whole: grad_w GEMM bf16 out", lambda: whole.detach().T @ h)
    compiled = torch.compile(chain_softmax)
    for c in (4096, 8192):
        hc, tc = h[:c], t[:c]
        kept = tc >= 0
        inv = torch.tensor(1.0 / N, device="cuda")
        lg = hc @ w.T
        timed("chunk: logits GEMM", lambda: hc @ w.T, chunk=c)
        g = lg.clone()
        timed("chunk: grad_h GEMM", lambda: g @ w, chunk=c)
        timed("chunk: grad_w GEMM bf16 out", lambda: g.T @ hc, chunk=c)
        timed("chunk: grad_w GEMM fp32 out (mm out_dtype)", lambda: torch.mm(g.T, hc, out_dtype=torch.float32), chunk=c)
        acc = torch.zeros(V, D, device="cuda")
        timed("chunk: grad_w fp32 out + add into the accumulator",
              lambda: acc.add_(torch.mm(g.T, hc, out_dtype=torch.float32)), chunk=c)
        try:
            timed("chunk: grad_w addmm into the accumulator (out_dtype)",
                  lambda: torch.addmm(acc, g.T, hc, out_dtype=torch.float32, out=acc), chunk=c)
        except Exception as e:  # noqa: BLE001 - what this torch supports is the finding
            print(json.dumps({"what": "addmm out_dtype", "error": f"{type(e).__name__}: {e}"[:300]}))
        try:
            timed("chunk: grad_w addmm into the accumulator (out_dtype, no out=)",
                  lambda: torch.addmm(acc, g.T, hc, out_dtype=torch.float32), chunk=c)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"what": "addmm out_dtype no out", "error": f"{type(e).__name__}: {e}"[:300]}))
        timed("chunk: softmax chain as shipped", lambda: chain_shipped(lg, tc, kept, inv), chunk=c)
        timed("chunk: softmax chain, softmax-based", lambda: chain_softmax(lg, tc, kept, inv), chunk=c)
        timed("chunk: softmax chain, torch.compile", lambda: compiled(lg, tc, kept, inv), chunk=c)


if __name__ == "__main__":
    main()
