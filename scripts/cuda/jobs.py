"""Real jobs for scripts/bench-share's `jobs` case: what people share a GPU for.

Usage: jobs.py KIND GO DURATION OUT
  trainer    a Llama-style transformer's full training step (random weights: hidden 1024,
             8 layers, 16 heads, batch 8 x 512 tokens, AdamW, bf16); launch-bound on an H200
  inference  the same model family served by a generate loop: one request (a 64-token prompt,
             32 new tokens, batch 1, KV cache), then THINK_S of think time, again
  resnet     torchvision ResNet-50's training step (random weights, batch 128, bf16, SGD);
             GPU-bound
Every job warms up and says so (it writes OUT.ready), then waits for the harness's file GO,
which holds START_AT: the time the common window opens, set once every job is ready, so no job
starts late however long its imports take. Jobs load together from then (the harness leaves
time before START_AT for the daemon to measure each job) and count the iterations (and, for
inference, each request's latency) that start inside [START_AT, START_AT + DURATION). A job
that still came late has its rate taken over the part it ran and says how late it was. Weights
are random and configs are written here: nothing is downloaded. Writes {"kind", "iterations",
"rate", "late_s", "ready_s", and for inference "p50_ms", "p99_ms", "requests"} to OUT.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

THINK_S = 0.030


def llama(layers: int = 8) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
                         num_hidden_layers=layers, num_attention_heads=16,
                         num_key_value_heads=16, max_position_embeddings=1024)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16)


def trainer() -> Callable[[], None]:
    model = llama()
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    tokens = torch.randint(0, 32000, (8, 512), device="cuda")

    def step() -> None:
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()   # a training loop logs its loss: the step's one synchronisation
    return step


def inference() -> Callable[[], None]:
    model = llama()
    model.eval()
    prompt = torch.randint(0, 32000, (1, 64), device="cuda")

    @torch.no_grad()
    def request() -> None:
        model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
    return request


def resnet() -> Callable[[], None]:
    import torchvision

    torch.manual_seed(0)
    model = torchvision.models.resnet50(weights=None).to("cuda", torch.bfloat16)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    images = torch.randn(128, 3, 224, 224, device="cuda", dtype=torch.bfloat16)
    labels = torch.randint(0, 1000, (128,), device="cuda")

    def step() -> None:
        loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
    return step


JOBS = {"trainer": trainer, "inference": inference, "resnet": resnet}


def wait_for_go(go: Path) -> float:
    """START_AT, once the harness has written it (atomically: a rename)."""
    while not go.exists():
        time.sleep(0.005)
    return float(go.read_text())


def main() -> None:
    kind, go, duration, out = sys.argv[1], Path(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    began = time.time()
    work = JOBS[kind]()
    think = THINK_S if kind == "inference" else 0.0
    for _ in range(2):   # the first call pays for kernel loading and autotuning
        work()
    torch.cuda.synchronize()
    ready_s = time.time() - began
    Path(out + ".ready").write_text(f"{ready_s:.3f}")
    start_at = wait_for_go(go)
    end = start_at + duration
    counted_from = max(start_at, time.time())
    latencies: list[float] = []
    while time.time() < end:
        begin = time.time()
        work()
        if begin >= start_at:
            latencies.append(time.time() - begin)
        if think:
            time.sleep(think)
    result: dict[str, object] = {"kind": kind, "iterations": len(latencies),
                                 "rate": len(latencies) / (end - counted_from),
                                 "late_s": counted_from - start_at, "ready_s": ready_s}
    if kind == "inference" and latencies:
        latencies.sort()
        result.update(requests=len(latencies),
                      p50_ms=1e3 * statistics.median(latencies),
                      p99_ms=1e3 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))])
    with open(out, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main()
