"""The exercise registry: the catalogue, and the files of written exercises."""

import re

from course.grader import cards, registry
from checks.plants import catchers, plants_for

DESIGN_IDS = ["m01", "m02", "m03", "m04", "m05", "m06", "m07", "e01", "e02", "e03", "e04", "e05", "e06",
              "k01", "k02", "k03", "k04", "g01", "e07", "k05"]


def test_catalogue_ids_are_the_design_ids_in_order():
    assert [e.id for e in registry.CATALOGUE] == DESIGN_IDS
    assert len({e.module for e in registry.CATALOGUE}) == len(DESIGN_IDS)


def test_m03_is_exercise_three_with_hint_a3_and_walkthrough_c3():
    m03 = registry.get("m03")
    assert (m03.number, m03.hint_ref, m03.solution_ref, m03.book_section) == (3, "A-3", "C-3", "§M.3")


def test_only_g01_needs_a_gpu():
    assert [e.id for e in registry.CATALOGUE if e.needs_gpu] == ["g01"]


def test_unknown_exercise_names_the_known_ones():
    try:
        registry.get("m99")
    except KeyError as exc:
        assert "m03" in exc.args[0]
    else:
        raise AssertionError("registry.get accepted an unknown id")


def test_m03_is_written():
    assert registry.get("m03").written


def test_written_cards_have_every_section_and_header():
    for ex in registry.written():
        assert cards.missing_sections(ex) == [], ex.id
        text = cards.text(ex)
        assert text.startswith(f"# #{ex.number} · Track {ex.track}"), ex.id
        meta = f"实现 mine/{ex.module}.py · 验收 ./check.sh {ex.id} · 提示 {ex.hint_ref} · 参考解 {ex.solution_ref}"
        assert meta in text, f"{ex.id}: meta line must contain {meta!r}"
        for level in (1, 2, 3):
            assert cards.hint(ex, level).strip(), f"{ex.id}: empty L{level}"


def test_every_l2_hint_says_how_to_run_the_exercise_outside_the_checker():
    for ex in registry.written():
        assert cards.self_test_line(ex) in cards.hint(ex, 2), \
            f"{ex.card.name}: L2 must end with the standard line (course/grader/cards.py SELF_TEST)"


def _mistake_bullets(text: str) -> list[str]:
    section = text.split("## 易错点", 1)[1].split("\n## ", 1)[0]
    return [line for line in section.splitlines() if re.match(r"^\s*[-*] ", line)]


def test_every_listed_mistake_has_a_plant():
    for ex in registry.written():
        bullets = _mistake_bullets(cards.text(ex))
        plants = plants_for(ex.module)
        assert bullets, f"{ex.id}: the card lists no 易错点"
        assert len(plants) >= len(bullets), f"{ex.id}: {len(bullets)} 易错点 but only {len(plants)} plants"


def test_plant_ids_are_unique_per_exercise():
    # the selftest grades each plant under its id: a second plant of the same id would overwrite the first's
    # planted file and share its grade, so one of them would never be graded
    for ex in registry.written():
        ids = [p.id for p in plants_for(ex.module)]
        assert len(ids) == len(set(ids)), f"{ex.id}: repeated plant ids {sorted({i for i in ids if ids.count(i) > 1})}"


def test_every_cpu_plant_names_the_check_that_catches_it_first():
    # the selftest runs this check first for the plant (checks/plants/catchers.json), so a grading costs one check
    # rather than the file; a missing or renamed entry would silently cost the whole file again (CI's 45 minutes)
    table = catchers()
    for ex in registry.written():
        defined = set(re.findall(r"^def (test_\w+)", ex.checks.read_text(encoding="utf-8"), re.M))
        for plant in plants_for(ex.module):
            if plant.gpu_only:
                continue
            name = table.get(ex.module, {}).get(plant.id)
            assert name, (f"{ex.id}: plant {plant.id} has no entry in checks/plants/catchers.json; regenerate with "
                          f"COURSE_PLANT_CATCHERS_UPDATE=1 ./check.sh selftest -k {ex.id}")
            assert name.split("[")[0] in defined, f"{ex.id}: catchers.json names {name}, which {ex.checks.name} no longer defines"


def test_written_exercises_have_book_pages():
    for ex in registry.written():
        n = ex.number
        assert (registry.ROOT / "book" / "appendix-a" / f"a-{n}.md").is_file(), ex.id
        assert (registry.ROOT / "book" / "appendix-c" / f"c-{n}.md").is_file(), ex.id
        track = registry.ROOT / "book" / f"track-{ex.track.lower()}"
        assert list(track.glob(f"{ex.id}-*.md")), ex.id


def test_appendix_a_is_generated_from_the_cards():
    from course.book import appendix as book
    for ex in registry.written():
        assert book.hint_path(ex).read_text(encoding="utf-8") == book.hint_page(ex), \
            f"{book.hint_path(ex)} is stale: run python -m course.book"


def test_book_links_resolve():
    book = registry.ROOT / "book"
    broken = []
    for page in book.rglob("*.md"):
        for target in re.findall(r"\]\(([^)#]+\.md)\)", page.read_text(encoding="utf-8")):
            if not (page.parent / target).is_file():
                broken.append(f"{page.relative_to(book)} -> {target}")
    assert not broken, f"broken links in the book: {broken}"
