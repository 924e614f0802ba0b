"""Data shared by every duplexq process: the fence, wire events, errors, config.

Nothing in this package does I/O. Types that cross Redis are msgspec structs
(compact, validated on decode, never pickled); types that come from users
(config files, client protocol) are pydantic models.
"""

from schemas.fence import Fence

__all__ = ["Fence"]
