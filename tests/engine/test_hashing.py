import hashlib

import numpy as np
import pytest

from engine.hashing import block_hashes, hash_block, make_seed


def test_chain_matches_the_contract():
    seed = make_seed("model", "")
    toks = list(range(40))
    hs = block_hashes(toks, 16, seed)
    assert len(hs) == 2  # the partial last block is never hashed
    h0 = int.from_bytes(hashlib.blake2b(seed + np.arange(16, dtype="<u4").tobytes(),
                                        digest_size=8).digest(), "little")
    assert hs[0] == h0
    assert hs[1] == hash_block(h0, seed, toks[16:32])


def test_prefix_stability_and_salts():
    seed = make_seed("model", "")
    a = block_hashes(list(range(64)), 16, seed)
    b = block_hashes(list(range(48)) + [0] * 16, 16, seed)
    assert a[:3] == b[:3] and a[3] != b[3]
    assert block_hashes(list(range(16)), 16, make_seed("model", "t1")) != a[:1]
    assert block_hashes(list(range(32, 64)), 16, seed, parent=a[1]) == a[2:]


def test_bad_block_size():
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0, b"\0" * 8)
