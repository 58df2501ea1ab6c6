"""GPU feed: batched GPU JPEG decode (nvImageCodec or torchvision), batched
no-sync transforms, and the CUDA prefetcher.

Never imported by ``packio/__init__``. Everything here imports on a CPU-only
machine; asking for CUDA where there is none raises a clear ``PackioError``.
"""

from packio.cuda.boxes import PackedBoxes
from packio.cuda.decode import BatchDecoder, decode_batch
from packio.cuda.prefetch import Prefetcher
from packio.cuda.transforms import (GPUTransform, center_crops, center_window, normalize, resample_matrix,
                                    resized_crop, sample_crops)

__all__ = ["BatchDecoder", "decode_batch", "Prefetcher", "PackedBoxes", "GPUTransform", "center_crops", "center_window",
           "normalize", "resample_matrix", "resized_crop", "sample_crops"]
