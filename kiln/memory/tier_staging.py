"""The staging the host tier's copies hold (kiln.memory.tier_copies), apart from them so that the ledger, which
counts it, does not import torch."""

from kiln.core.units import MIB

# device staging on CUDA: each direction (stores, loads) a ring of RING buffers of this many bytes of rows,
# allocated with the host tier
STAGING_CHUNK_BYTES = 16 * MIB
RING = 2
STAGING_BYTES = 2 * RING * STAGING_CHUNK_BYTES
# pinned host staging held by the copies in flight, each direction, before the oldest is waited for
HOST_STAGING_BYTES = 256 * MIB
