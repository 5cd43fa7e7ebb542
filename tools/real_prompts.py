"""Real English prompts for the demo and the benchmark on a trained model (Gemma 3 270M).

Sixteen completion-style prompts (the model is a base model) from a few tokens to about
1300: short factual openings, mid-length passages, and four prompts longer than Gemma 3's
512-token sliding window, made of several of the passages below, so that sliding layers
drop pages while full layers keep every token.
"""

from __future__ import annotations

__all__ = ["LONG_PROMPT_NAMES", "PASSAGES", "REAL_PROMPTS", "real_prompts"]

_RIVER = (
    "The river that runs through the old town was once the reason the town existed at all. "
    "Barges carried grain, timber and wool down to the coast, and the mills along its banks "
    "ground flour for three counties. When the railway arrived in the eighteen-fifties the "
    "barges became fewer every year, and by the end of the century most of the mills had "
    "closed. Some were turned into warehouses, one became a school, and the largest stood "
    "empty for almost sixty years before it was restored as a library. Today the towpath is "
    "used by walkers and cyclists, and in summer the water is busy with canoes. The locks "
    "still work, although they are opened by volunteers rather than by the lock keepers who "
    "once lived in the small brick cottages beside them."
)
_BREAD = (
    "To bake a simple loaf of bread you need flour, water, salt and yeast. Mix five hundred "
    "grams of strong white flour with ten grams of salt and seven grams of dried yeast, then "
    "add about three hundred and fifty millilitres of warm water and stir until a rough dough "
    "forms. Knead it on a lightly floured surface for ten minutes, until it is smooth and "
    "springs back when pressed. Leave it in a covered bowl in a warm place until it has "
    "doubled in size, which usually takes about an hour. Knock it back, shape it into a loaf, "
    "put it in a greased tin and let it rise again for thirty minutes. Bake it in a hot oven "
    "for thirty to thirty-five minutes; it is done when the base sounds hollow when tapped."
)
_STARS = (
    "A star is a ball of hot gas held together by its own gravity. In its core, hydrogen "
    "nuclei fuse into helium, and the energy released by that fusion pushes outward against "
    "the weight of the layers above. For most of a star's life these two forces are in "
    "balance. Small stars burn their fuel slowly and can shine for hundreds of billions of "
    "years, while the most massive stars exhaust their hydrogen in a few million years. When "
    "the fuel runs out, the balance is lost. A star like the Sun swells into a red giant, "
    "sheds its outer layers and leaves behind a white dwarf, while a much heavier star "
    "collapses and explodes as a supernova, leaving a neutron star or a black hole."
)
_MARKET = (
    "Every Saturday morning the square in front of the town hall fills with market stalls. "
    "Farmers from the surrounding villages sell vegetables, eggs, cheese and honey, and a "
    "baker arrives before dawn with trays of bread that are usually gone by ten o'clock. "
    "There is a man who sharpens knives, a woman who repairs bicycles, and a stall that sells "
    "nothing but old maps and postcards. Children gather around the stand where a beekeeper "
    "shows a glass-sided hive, and older residents meet at the cafe on the corner to talk "
    "about the weather, the price of apples and the plans for the new bridge."
)
_COMPUTER = (
    "A computer program is a list of instructions that a machine follows one after another. "
    "The processor fetches an instruction from memory, decodes it, carries it out and moves "
    "on to the next one, billions of times every second. Programs are usually written in a "
    "language that people can read, such as Python or C, and then translated into the "
    "simple operations the processor understands. Data is kept in memory while the program "
    "runs and on a disk when it must survive after the machine is switched off. Because "
    "memory is much faster than a disk but much smaller, a great deal of engineering goes "
    "into deciding what to keep close at hand and what can wait."
)
_LETTER = (
    "Dear Aunt Margaret, thank you so much for the parcel, which arrived on Tuesday just as "
    "it started to rain. The scarf is beautiful and I have worn it every day since. The new "
    "flat is small but bright, and from the kitchen window I can see the hills beyond the "
    "railway line. My job at the museum is going well: this week I helped to move a collection "
    "of clocks into the east gallery, and I learned more about springs and pendulums than I "
    "ever expected to know. I hope the garden is recovering after the storm."
)

_NOTES_INTRO = "Here are some notes I wrote down this week, one topic after another.\n\n"

#: The prompts, shortest first (names are stable; the texts may grow, never shrink).
#: The passages the long prompts are made of, each on its own.
PASSAGES = (_RIVER, _BREAD, _STARS, _MARKET, _COMPUTER, _LETTER)

REAL_PROMPTS: dict[str, str] = {
    "capital": "The capital of France is",
    "water": "Water boils at a temperature of",
    "planets": "The eight planets of the solar system, in order from the Sun, are",
    "story": "Once upon a time, in a small village at the edge of a great forest, there lived",
    "recipe": "Here is a simple recipe for a tomato soup that takes twenty minutes:",
    "history": ("The printing press, invented in the fifteenth century, changed Europe because"),
    "letter": _LETTER + " Next month I",
    "bread": _BREAD + " If the loaf comes out dense and heavy, the most likely reason is",
    "stars": _STARS + " The Sun itself is about",
    "market": _MARKET + " Last Saturday, something unusual happened:",
    "computer": _COMPUTER + " The simplest example of this is",
    "river": _RIVER + " The library that now stands in the old mill",
    "notes_three": (
        _NOTES_INTRO
        + "\n\n".join((_RIVER, _BREAD, _STARS, _MARKET, _COMPUTER))
        + "\n\nOf all these topics, the one I would most like to learn more about is"
    ),
    "notes_four": (
        _NOTES_INTRO
        + "\n\n".join((_COMPUTER, _LETTER, _RIVER, _STARS, _MARKET, _BREAD))
        + "\n\nTo summarise the week in one sentence:"
    ),
    "notes_five": (
        _NOTES_INTRO
        + "\n\n".join((_STARS, _MARKET, _COMPUTER, _BREAD, _LETTER, _RIVER, _STARS, _BREAD))
        + "\n\nThe question I keep coming back to is"
    ),
    "notes_six": (
        _NOTES_INTRO
        + "\n\n".join(
            (_MARKET, _RIVER, _LETTER, _COMPUTER, _STARS, _BREAD, _MARKET, _RIVER, _COMPUTER)
        )
        + "\n\nLooking back over these notes, the thing they have in common is"
    ),
}

#: The prompts longer than a 512-token sliding window with Gemma 3's tokenizer.
LONG_PROMPT_NAMES: tuple[str, ...] = ("notes_three", "notes_four", "notes_five", "notes_six")


def real_prompts(count: int | None = None) -> list[tuple[str, str]]:
    """``(name, text)`` pairs, ``count`` of them (all by default, cycling past sixteen)."""
    items = list(REAL_PROMPTS.items())
    if count is None:
        return items
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    return [items[i % len(items)] for i in range(count)]
