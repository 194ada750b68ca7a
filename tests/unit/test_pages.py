"""sharded-exp-docs: a page by its name or a part of it; a misspelled one gets the page meant."""

from sharded_exp.pages import main


def test_a_misspelled_docs_page_gets_the_page_meant(capsys):
    assert main(["planer"]) == 2
    assert "did you mean guide/planner?" in capsys.readouterr().err
    assert main(["planner"]) == 0  # a part of a name still finds its page
