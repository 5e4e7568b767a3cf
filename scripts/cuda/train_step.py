"""A training step that fills the GPU: an MLP of 8192-wide bf16 layers with AdamW.

Prints the median milliseconds per step over the timed steps. Used by scripts/bench-hook.
"""

import statistics
import sys
import time

import torch


def main() -> None:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 40
    torch.manual_seed(0)
    width, depth, batch = 8192, 8, 8192
    layers = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width, bias=False), torch.nn.GELU()]
    model = torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randn(batch, width, device="cuda", dtype=torch.bfloat16)
    times = []
    for step in range(steps + 10):
        start = time.perf_counter()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if step >= 10:
            times.append((time.perf_counter() - start) * 1e3)
    print(f"{statistics.median(times):.3f}")


if __name__ == "__main__":
    main()
