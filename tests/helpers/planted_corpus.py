"""The corpus the quality filters are measured on (tests/data_pipeline/test_filters.py, benchmarks/data_filters.py):
good prose from the shipped documentation corpus, with planted junk of each kind a filter is meant to remove.

Good prose: the prose paragraphs of tiny_llama's corpus (Python's documentation: paragraphs of at least 25 words
that end with a full stop, with no code, tables, markup or quoted identifiers), each once, four to a document. The
rest of that corpus is code-heavy reference text, which web-text filters rightly call low quality
(docs/data_filters.md measures it too). Each junk kind is `PER_KIND` documents built from seeded choices:

| kind          | what it is                                              | the filter meant to remove it |
|---------------|---------------------------------------------------------|-------------------------------|
| repeated      | a prose paragraph, then one advert line 15 times        | gopher_repetition             |
| symbols       | symbol soup: #, $$, @, ... between a few words          | gopher_quality                |
| boilerplate   | navigation, cookie and legal lines, or lorem ipsum      | c4                            |
| short_lines   | a list of short items                                   | fineweb_quality               |
| non_english   | French, German, Spanish, Italian, Dutch or Portuguese   | language                      |
| very_short    | a few words                                             | length                        |
| contact       | prose with a contact e-mail address                     | regex                         |
"""
import json
import re
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
CORPUS = REPO / "recipes/tiny_llama/corpus.jsonl"
PER_KIND = 20
KINDS = {"repeated": "gopher_repetition", "symbols": "gopher_quality", "boilerplate": "c4",
         "short_lines": "fineweb_quality", "non_english": "language", "very_short": "length", "contact": "regex"}
CONTACT_PATTERN = r"[\w.]+@[\w-]+\.(com|org|net)"
MARKUP = re.compile(r"[{}<>*=#|\[\]\"`_]|::|>>>|\.\.\.|\n[ \t]")  # code, markup and "quoted" identifiers

ADVERTS = ["Buy cheap watches online today at the best prices.", "Click here to win a free holiday now.",
           "Best deals on shoes, order now and save big.", "Subscribe to our newsletter for weekly offers."]
NAVIGATION = ["Home", "About us", "Contact", "Products", "Login", "Sign up", "Careers", "Blog", "Help centre",
              "Site map", "This website uses cookies", "Privacy policy", "Terms of use", "Cookie settings",
              "All rights reserved", "Follow us on social media", "Share this page", "Back to top"]
LOREM = ("Lorem ipsum dolor sit amet, consectetur adipiscing elit. Sed do eiusmod tempor incididunt ut labore et "
         "dolore magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris.")
FOREIGN = [
    "La fonction renvoie une nouvelle liste contenant les éléments triés. Elle ne modifie jamais la liste "
    "d'origine. Les arguments facultatifs permettent de choisir une clé et l'ordre du tri. Une erreur est levée "
    "si les éléments ne peuvent pas être comparés entre eux.",
    "Die Methode liest die Datei Zeile für Zeile und gibt jede Zeile als Zeichenkette zurück. Am Ende der Datei "
    "wird eine leere Zeichenkette geliefert. Wenn die Datei nicht existiert, wird eine Ausnahme ausgelöst, die "
    "den Namen der Datei enthält.",
    "El módulo ofrece funciones para trabajar con fechas y horas de forma sencilla. Cada objeto guarda el año, el "
    "mes y el día, y puede compararse con otros objetos del mismo tipo. Los cálculos tienen en cuenta los años "
    "bisiestos.",
    "Questa classe rappresenta una coda in cui gli elementi vengono aggiunti da un lato e rimossi dall'altro. "
    "Tutte le operazioni sono sicure quando più thread la usano contemporaneamente. Il metodo restituisce il "
    "numero di elementi presenti nella coda.",
    "Deze functie opent een verbinding met de server en wacht op een antwoord. Als er binnen de opgegeven tijd "
    "geen antwoord komt, wordt de verbinding gesloten. De standaardwaarde voor de wachttijd is dertig seconden.",
    "O interpretador executa cada instrução na ordem em que aparece no arquivo. As variáveis criadas dentro de "
    "uma função só existem enquanto ela está em execução. Para guardar um valor entre chamadas, use um atributo "
    "do objeto.",
]
SHORT = ["Click here.", "Page not found.", "Loading, please wait.", "Thanks for reading!", "Read more",
         "Posted by admin on Monday.", "Sorry, this item is out of stock."]
SYMBOLS = ["#", "##", "$$", "%%", "&", "@@", "*", "|", "~~", "^", "+=", "//"]


def prose_paragraphs() -> list[str]:
    """Each prose paragraph once, in corpus order."""
    paragraphs = {}
    for line in CORPUS.read_text().splitlines():
        for block in json.loads(line)["text"].split("\n\n"):
            words = block.split()
            if len(words) >= 25 and block.rstrip().endswith(".") and not MARKUP.search("\n" + block):
                paragraphs.setdefault(" ".join(words))
    return list(paragraphs)


def prose_documents() -> list[str]:
    """Four paragraphs to a document, a quarter of the corpus apart (so rarely two of one docstring)."""
    paragraphs = prose_paragraphs()
    quarter = len(paragraphs) // 4
    return ["\n\n".join(paragraphs[i + k * quarter] for k in range(4)) for i in range(quarter)]


def junk(kind: str, index: int, paragraphs: list[str]) -> str:
    rng = np.random.default_rng([index, len(kind)])
    paragraph = paragraphs[int(rng.integers(len(paragraphs)))]
    if kind == "repeated":
        return paragraph + "\n" + "\n".join([ADVERTS[index % len(ADVERTS)]] * 15)
    if kind == "symbols":
        words = paragraph.split()[:20]
        return " ".join(f"{rng.choice(SYMBOLS)} {rng.choice(SYMBOLS)} {word}" for word in words)
    if kind == "boilerplate":
        if index % 2:
            return f"{paragraph}\n\n{LOREM}\n\n{LOREM}"
        return "\n".join(rng.choice(NAVIGATION, 12, replace=False))
    if kind == "short_lines":
        words = paragraph.split()
        return "Contents\n" + "\n".join(f"- {words[i]} {words[i + 1]}" for i in range(0, min(len(words) - 1, 40), 2))
    if kind == "non_english":
        return " ".join(rng.permutation(FOREIGN)[:3])
    if kind == "very_short":
        return str(rng.choice(SHORT))
    return f"{paragraph} For questions write to team{index}@example.com and we will answer."


def planted_corpus() -> tuple[list[str], list[str]]:
    """The documents and each one's kind ("prose" or a junk kind), junk interleaved with the prose."""
    prose = prose_documents()
    paragraphs = prose_paragraphs()
    texts, kinds = list(prose), ["prose"] * len(prose)
    for kind in KINDS:
        for index in range(PER_KIND):
            position = int(np.random.default_rng([index, 7, len(kind)]).integers(len(texts) + 1))
            texts.insert(position, junk(kind, index, paragraphs))
            kinds.insert(position, kind)
    return texts, kinds


def write_corpus(path: Path) -> tuple[list[str], list[str]]:
    texts, kinds = planted_corpus()
    path.write_text("".join(json.dumps({"text": t, "kind": k}) + "\n" for t, k in zip(texts, kinds)))
    return texts, kinds
