"""The peers harness (../shared/peers/bench.py, unchanged) with one more W1 loader,
``dali-cpu``: NVIDIA DALI's CPU pipeline as the ResNet-50 recipe's ``--data-backend
dali-cpu`` builds it (``fn.readers.file`` over the image folder, ``fn.decoders.image(device="cpu")``),
then ``fn.resize`` to 224x224 (linear, no antialias: as the harness' cv2.INTER_LINEAR), uint8
batches of 64 handed out as NCHW views, with the harness' labels and boxes. nw=N is DALI's
``num_threads=N`` in this process (nw=0 as 1). Every other option is the harness' own:

    python tools/peers_dali.py --data /tmp/synth5k --loaders dali-cpu,packio-lmdb,folder-simplejpeg \\
        --workers 0,2 --passes 3 --limits --md /tmp/w1-dali.md

Needs DALI in the running Python (``pip install nvidia-dali-cuda130``: its CPU pipeline runs without
a GPU). ``--probes`` re-runs the shared bench.py in a child, which does not know ``dali-cpu``.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT  # noqa: E402

PEERS = ROOT.parent / "shared" / "peers" / "bench.py"


class DaliCpuLoader:
    """W1 through DALI's CPU pipeline, in file order; re-iterable (the pipeline is built once)."""

    def __init__(self, bench: Any, ctx: Any, nw: int) -> None:
        from nvidia.dali import fn, pipeline_def, types
        from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

        self.bench, self.ctx = bench, ctx
        n = len(ctx.src)

        @pipeline_def(batch_size=ctx.batch, num_threads=max(1, nw), device_id=None, prefetch_queue_depth=2, seed=0)
        def w1() -> Any:
            jpegs, idx = fn.readers.file(files=[ctx.src.path(i) for i in range(n)], labels=list(range(n)),
                                         random_shuffle=False, name="Reader")
            img = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
            return fn.resize(img, resize_x=bench.SIZE, resize_y=bench.SIZE, interp_type=types.INTERP_LINEAR,
                             antialias=False), idx

        pipe = w1()
        pipe.build()
        self.it = DALIGenericIterator([pipe], ["image", "idx"], reader_name="Reader",
                                      last_batch_policy=LastBatchPolicy.PARTIAL, auto_reset=True)

    def __iter__(self) -> Iterator[tuple]:
        for out in self.it:
            idx = out[0]["idx"].view(-1).tolist()
            yield (out[0]["image"].permute(0, 3, 1, 2), *self.bench._folder_targets(self.ctx, idx))


def load_harness(path: Path = PEERS) -> Any:
    """The shared peers harness as a module, with ``dali-cpu`` registered."""
    if not path.is_file():
        raise SystemExit(f"peers_dali.py: the peers harness is not at {path}; it lives in ../shared/peers")
    spec = importlib.util.spec_from_file_location("peers_bench", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules["peers_bench"] = bench
    spec.loader.exec_module(bench)
    bench.register_loader("dali-cpu", "folder", lambda ctx, nw: DaliCpuLoader(bench, ctx, nw),
                          note="NVIDIA DALI CPU pipeline: readers.file + decoders.image(cpu) + resize 224 linear "
                               "(no antialias), uint8 NHWC as an NCHW view",
                          workers_note="DALI threads in this process: nw=N is num_threads=N (nw=0 as 1)")
    return bench


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
    try:
        import nvidia.dali  # noqa: F401
    except ImportError:
        if not any(a in ("-h", "--help") for a in argv):
            raise SystemExit("peers_dali.py: DALI is not installed in this Python; pip install nvidia-dali-cuda130 "
                             "(into the peers venv, not packio's)") from None
    return load_harness().main(argv) or 0


if __name__ == "__main__":
    sys.exit(main())
