"""MkDocs hook: serve MathJax from the installed `django-static-mathjax` package (MathJax
3.2.2, no Django needed), so the built site renders formulas with no network access.

The SVG build (`tex-svg.js`) is one self-contained file: no web fonts to fetch.
"""

from pathlib import Path

import mathjax
from mkdocs.structure.files import File

MATHJAX = Path(mathjax.__file__).parent / "static" / "mathjax" / "es5" / "tex-svg.js"


def on_files(files, config):
    files.append(File.generated(config, "javascripts/tex-svg.js", abs_src_path=str(MATHJAX)))
    return files
