"""Scratch: B_simple vs the noise scale in Adam's preconditioned metric, at the weights of benchmark (a)."""
import sys
sys.path.insert(0, "benchmarks")
import torch
torch.set_num_threads(1)
import batch_size as b
train, _ = b.build_data()
model = b.build_model()
opt = torch.optim.AdamW(model.parameters(), lr=b.REF_LR, betas=(0.9, b.REF_BETA2))
for i in range(20):
    s, n = b.loss_sum(model, train[i * 16:(i + 1) * 16]); (s / n).backward(); opt.step(); opt.zero_grad()
params = [p for p in model.parameters() if p.requires_grad]
step = opt.state[params[0]]["step"]
v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in params]).double() / (1 - b.REF_BETA2 ** float(step))
P = 1 / (v.sqrt() + 1e-8)
pool = train[320:]
gen = torch.Generator().manual_seed(1)
S1 = torch.zeros_like(P); S2 = torch.zeros_like(P); m = 800
for _ in range(m):
    idx = torch.randint(len(pool), (4,), generator=gen)
    s, n = b.loss_sum(model, pool[idx]); (s / n).backward()
    gi = torch.cat([p.grad.reshape(-1) for p in params]).double(); model.zero_grad(set_to_none=True)
    S1 += gi; S2 += gi * gi
tok = 4 * (b.SEQ - 1); mean = S1 / m; var = (S2 - S1 * S1 / m) / (m - 1)
for name, w in (("plain", torch.ones_like(P)), ("adam P", P), ("adam P^2", P * P)):
    trace = tok * (var * w).sum()
    gsq = (mean.square() * w).sum() - trace / (tok * m)
    print(f"{name:9s} gns {float(trace / gsq):10.1f} tokens")
