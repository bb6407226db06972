"""The streaming loader alone (``lit_dllm.data.packed_stream``): tokens per second and peak memory while it reads,
tokenises and packs a text corpus of jsonl shards, for corpora of growing size.

Each ``--sizes-mb`` corpus is written to a temporary folder as ``--shards`` jsonl shards of random words (document
lengths log-normal, median ``--median-chars`` characters, so some documents are longer than a row and get split), then
read for one epoch through ``StreamLoader(PackedStream(...), num_workers=--workers)``: ``datasets`` streaming, the
tokenizer in the workers (the embedded character tokenizer unless ``--tokenizer``), best-fit decreasing packing into
rows of ``--pack-length``, batches of ``--batch-size`` rows. No model runs: this is the ceiling the loader puts on
training throughput. Tokens are real tokens (the documents' own, no block fill or padding). Peak memory is the largest
sum of PSS (resident memory, pages shared between the forked workers counted once) over the main process and its
loader workers, sampled every 50 ms; constant memory means it does not grow with the corpus.

Usage::

    python bench/bench_loader.py                                   # 16 and 64 MB, 2 workers
    python bench/bench_loader.py --sizes-mb 256 1024 4096 --workers 8 --out results/loader.md
    python bench/bench_loader.py --sizes-mb 4096 --max-seconds 300   # the first 5 minutes of a 4 GB pass
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _common import emit, environment_line, markdown_table

import numpy as np
import psutil

from lit_dllm.data.collate import DLLMCollator
from lit_dllm.data.formats import encode_texts
from lit_dllm.data.packing import PackedCollator
from lit_dllm.data.packed_stream import PackedStream, StreamLoader
from lit_dllm.data.streaming import StreamingSource
from lit_dllm.data.tokenizer import load_tokenizer


class TextEncoder:
    """``encode`` for the stream: each text one fully supervised document ending with eos."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        examples = encode_texts(self.tokenizer, batch["text"], max_seq_len=1 << 62, pack=False)
        return {key: [example[key] for example in examples] for key in ("input_ids", "loss_mask", "attention_mask")}


def write_corpus(folder: Path, megabytes: int, shards: int, median_chars: int, seed: int) -> int:
    """``megabytes`` of random-word documents in ``shards`` jsonl files, written in parallel; returns the document
    count."""
    jobs = [(folder / f"part-{shard:05d}.jsonl", (megabytes << 20) // shards, median_chars, (seed, shard))
            for shard in range(shards)]
    with ProcessPoolExecutor(min(shards, os.cpu_count() or 1)) as pool:
        return sum(pool.map(write_shard, *zip(*jobs)))


def write_shard(path: Path, budget: int, median_chars: int, seed: tuple[int, int]) -> int:
    """``budget`` bytes of random-word documents (log-normal lengths) as one jsonl file; returns the document count."""
    rng = np.random.default_rng(seed)
    words = np.array(["".join(rng.choice(list("abcdefghijklmnopqrstuvwxyz"), n)) for n in rng.integers(2, 10, 5000)])
    documents = 0
    with path.open("w") as file:
        while budget > 0:
            length = int(np.clip(median_chars * np.exp(rng.standard_normal()), 50, 50 * median_chars))
            line = json.dumps({"text": " ".join(words[rng.integers(0, len(words), max(1, length // 6))])}) + "\n"
            file.write(line)
            budget -= len(line)
            documents += 1
    return documents


class PeakMemory:
    """The largest sum of PSS over this process and its children, sampled in a thread; also by quarter of the run
    (constant memory: the quarters' peaks stay level as the pass goes on)."""

    def __init__(self, every: float = 0.05):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        me = psutil.Process()
        while not self._stop.is_set():
            total = 0
            for process in [me, *me.children(recursive=True)]:
                try:
                    total += process.memory_full_info().pss
                except psutil.Error:
                    pass
            self.peak = max(self.peak, total)
            self.samples.append((time.perf_counter(), total))
            time.sleep(self.every)

    def quarters(self) -> list[int]:
        """The peak of each quarter of the sampled time."""
        start, end = self.samples[0][0], self.samples[-1][0]
        peaks = [0] * 4
        for when, total in self.samples:
            quarter = min(3, int(4 * (when - start) / max(end - start, 1e-9)))
            peaks[quarter] = max(peaks[quarter], total)
        return peaks

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def measure(folder: Path, args, encode) -> dict:
    collator = PackedCollator(DLLMCollator(pad_token_id=0, eos_token_id=1), args.pack_length)
    stream = PackedStream(StreamingSource.open(folder), encode, collator, args.batch_size, window=args.window,
                          seed=args.seed, epochs=1)
    loader = StreamLoader(stream, num_workers=args.workers)
    before = psutil.Process().memory_full_info().pss
    tokens = batches = 0
    with PeakMemory() as memory:
        start = time.perf_counter()
        for batch in loader:
            tokens += int(batch["input_lengths"].sum())
            batches += 1
            if args.max_seconds and time.perf_counter() - start > args.max_seconds:
                break
        seconds = time.perf_counter() - start
    return {"tokens": tokens, "batches": batches, "seconds": seconds, "peak": memory.peak, "before": before,
            "quarters": memory.quarters(),
            "counts": loader.counts}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--pack-length", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--window", type=int, default=1000)
    parser.add_argument("--median-chars", type=int, default=3000)
    parser.add_argument("--tokenizer", default=None, help="hub id or local path; default: the embedded tokenizer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tmp", default=None, help="where to write the corpora (default: the system temp dir)")
    parser.add_argument("--max-seconds", type=float, default=None,
                        help="stop reading a corpus after this long (a partial pass, marked in the table)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    encode = TextEncoder(load_tokenizer(args.tokenizer, "<|mask|>", False, require_mask=False))
    rows = []
    for megabytes in args.sizes_mb:
        with tempfile.TemporaryDirectory(dir=args.tmp) as folder:
            documents = write_corpus(Path(folder), megabytes, args.shards, args.median_chars, args.seed)
            result = measure(Path(folder), args, encode)
        counts = result["counts"]
        whole = result["seconds"] <= (args.max_seconds or float("inf"))
        assert counts["tokens"] == result["tokens"] or not whole, (counts, result["tokens"])
        rows.append([
            megabytes, "whole" if whole else f"first {result['seconds']:.0f} s", args.shards, args.workers, documents, counts["long_split"], f"{result['tokens']:,}",
            f"{result['seconds']:.1f}", f"{result['tokens'] / result['seconds']:,.0f}",
            f"{result['batches'] / result['seconds']:.1f}", f"{result['before'] / 2**20:.0f}",
            f"{result['peak'] / 2**20:.0f}", " / ".join(f"{peak / 2**20:.0f}" for peak in result["quarters"]),
        ])
    header = ["corpus MB", "read", "shards", "workers", "documents", "split", "tokens", "s", "tokens/s", "batches/s",
              "PSS before MB", "peak PSS MB (main + workers)", "peak by quarter of the pass MB"]
    emit(f"{environment_line()}\n\npack_length={args.pack_length}, batch_size={args.batch_size} rows, "
         f"window={args.window}, tokenizer={args.tokenizer or 'embedded (characters)'}\n\n"
         + markdown_table(header, rows), args.out)


if __name__ == "__main__":
    main()
