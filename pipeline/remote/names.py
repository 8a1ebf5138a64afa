"""Names from outside are data, never paths until checked: a file name in a bucket's complete.json, a tag
folder in a bucket listing, a shard name in a dataset.json, a parameter name in a checkpoint that DeepSpeed's
converter turns into folders. Whoever can write those (a shared bucket, a leaked key, a downloaded data set)
must not be able to place a file outside the folder the name belongs to: `/home/you/.bashrc` or
`../../site-packages/x.pth` would be joined to a local folder as they come.

`relative_name(name, source)` is the one rule: a non-empty relative path of `/`-separated parts, none of them
empty, `.` or `..`, without backslashes, NUL or other control characters. Anything else is `UnsafeName`: one
line naming where the name came from; the caller writes nothing.
"""

from __future__ import annotations

from pathlib import Path


class UnsafeName(ValueError):
    """A name from outside that is not a relative path inside its folder; the message names its source."""


def why_unsafe(name: object) -> str | None:
    """Why `name` is not a relative path inside its folder, in a few words; None when it is one."""
    if not isinstance(name, str) or not name:
        return "not a non-empty string"
    if any(ord(c) < 0x20 or c == "\x7f" for c in name):
        return "it holds a control character"
    if "\\" in name:
        return "it holds a backslash"
    if name.startswith("/"):
        return "it is an absolute path"
    parts = name.split("/")
    if ".." in parts:
        return "it climbs out with '..'"
    if any(p in ("", ".") for p in parts):
        return "it has an empty or '.' part"
    return None


def relative_name(name: object, source: str) -> str:
    """`name` unchanged when it is a relative path that stays inside the folder it is joined to; UnsafeName
    naming `source` (the file or listing it came from) otherwise."""
    why = why_unsafe(name)
    if why is not None:
        raise UnsafeName(f"{source}: the name {str(name)[:200]!r} is refused ({why}): a name read from there is "
                         f"a path inside its folder, or nothing; nothing was written")
    return str(name)


def inside(folder: Path, name: object, source: str) -> Path:
    """FOLDER/name for a checked `name` (relative_name)."""
    return Path(folder) / relative_name(name, source)
