"""The README's Python example runs as written."""

import re
import textwrap
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    blocks = [textwrap.dedent(block) for block in blocks]  # blocks inside list items
    assert blocks
    namespace = {"__name__": "readme"}  # later blocks build on earlier ones
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)
