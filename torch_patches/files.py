"""The value every layer passes around: torch files by repo path.

``{repo-relative path: content}``; ``None`` means the file is absent (a patch
creates it, or deletes it). Pure data: reading and writing the disk belongs to
the targets (:mod:`torch_patches.targets`) and :mod:`torch_patches.fsutil`.
"""

from typing import Dict, Optional

Files = Dict[str, Optional[bytes]]
