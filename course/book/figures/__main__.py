from ...grader.select import ROOT
from . import write_all

for path in write_all(ROOT / "book" / "figures"):
    print(f"wrote {path.relative_to(ROOT)}")
