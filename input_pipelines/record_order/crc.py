"""TFRecord's checksum: the masked CRC-32C (Castagnoli) of a record's bytes,
as TensorFlow's writer stores it after each record and length.

    masked = ((crc >> 15) | (crc << 17)) + 0xa282ead8   (mod 2**32)

The CRC itself is google-crc32c's (Google's C library, hardware CRC32
instructions where the CPU has them); the masking is one vectorized pass
over a batch.
"""

from typing import Sequence

import numpy as np

_MASK_DELTA = 0xA282EAD8


def masked_crc32c(records: Sequence[bytes]) -> np.ndarray:
    """The masked CRC-32C of each of `records`, as uint32."""
    import google_crc32c
    crcs = np.fromiter((google_crc32c.value(r) for r in records),
                       dtype=np.uint64, count=len(records))
    rotated = ((crcs >> np.uint64(15)) | (crcs << np.uint64(17))) & \
        np.uint64(0xFFFFFFFF)
    return ((rotated + np.uint64(_MASK_DELTA)) & np.uint64(0xFFFFFFFF)
            ).astype(np.uint32)
