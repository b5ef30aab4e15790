"""README and docs stand alone: every relative link points at a file inside the repository that exists."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_relative_links_stay_inside_the_repository_and_exist():
    bad = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]:  # docs/results/ too
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if re.match(r"[a-z]+://|#|mailto:", target):
                continue
            path = (doc.parent / target.split("#")[0]).resolve()
            if not path.is_relative_to(REPO) or not path.exists():
                bad.append(f"{doc.relative_to(REPO)}: {target}")
    assert not bad, "links outside the repository or to nothing:\n" + "\n".join(bad)
