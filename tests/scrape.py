"""Scraping a real program's metrics port in a test: a free port, a GET, the parsed series."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def fetch(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def scrape(port: int, wait: float = 15.0) -> str:
    """/metrics of the port on 127.0.0.1, waiting up to `wait` s for it to open."""
    deadline = time.monotonic() + wait
    while True:
        try:
            status, text = fetch(f"http://127.0.0.1:{port}/metrics")
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)
            continue
        assert status == 200, text
        return text


def samples(text: str) -> dict[str, list[Sample]]:
    """Every sample by its name (a counter's `_total`, a histogram's `_bucket` ...)."""
    out: dict[str, list[Sample]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


SERIES_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"),
                   "summary": ("", "_sum", "_count")}


def series_names(text: str) -> set[str]:
    """The names a query can use, whether or not a family has samples now: a counter's with
    `_total`, a histogram's `_bucket`, `_sum` and `_count`, a gauge's as it is."""
    names = set()
    for family in text_string_to_metric_families(text):
        names |= {family.name + end for end in SERIES_SUFFIXES.get(family.type, ("",))}
    return names


def value(found: dict[str, list[Sample]], name: str, **labels: str) -> float:
    """The one sample of `name` whose labels include `labels`."""
    (sample,) = [s for s in found.get(name, [])
                 if all(s.labels.get(k) == v for k, v in labels.items())]
    return float(sample.value)
