"""Signatures of saves and parked entries: :mod:`nbkv.core.signing`, where it lives now.

The key and the HMAC moved down to the core so that the KV layer's calibration file is
signed under the same key (:mod:`nbkv.kv.calibrate`); the store's modules keep their names.
"""

from nbkv.core.signing import (
    ALG,
    KEY_ENV,
    KEY_FILE,
    SigningKey,
    key_path,
    problem,
    sign,
    user_key,
)

__all__ = ["ALG", "KEY_ENV", "KEY_FILE", "SigningKey", "key_path", "problem", "sign",
           "user_key"]
