"""Write docs/compatibility.md from the composition table and the matrix, and print the matrix's
cell count and pair coverage.

    python scripts/compatibility.py           # write the page
    python scripts/compatibility.py --check   # exit 1 if the page is stale
"""

import sys

from torchpar.tools import matrix


def main(argv: list[str]) -> int:
    cells = matrix.generate()
    held, runnable = matrix.coverage(cells)
    print(f"{len(cells)} cells; pairs held {held} of {runnable} that can run ({100 * held / runnable:.0f}%); "
          f"{len(matrix.refused_cells())} rules, each refusing a cell of its own")
    text, path = matrix.page(), matrix.docs_path()
    if "--check" in argv:
        if path.read_text() != text:
            print(f"{path} is stale: run python scripts/compatibility.py", file=sys.stderr)
            return 1
        return 0
    path.write_text(text)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
