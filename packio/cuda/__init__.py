"""GPU feed: batched nvjpeg decode, GPU transforms, CUDA prefetcher.

Never imported by ``packio/__init__``. Everything here imports on a CPU-only
machine; asking for CUDA where there is none raises a clear ``PackioError``.
"""

from packio.cuda.decode import decode_batch
from packio.cuda.prefetch import Prefetcher
from packio.cuda.transforms import GPUTransform, center_crop, hflip, normalize, random_resized_crop, resize

__all__ = ["decode_batch", "Prefetcher", "GPUTransform", "center_crop", "hflip", "normalize",
           "random_resized_crop", "resize"]
