"""Numeric word problems with one integer answer in 0..999, and their held-out split.

    problems = generate_problems("arithmetic", count=1000, split="train", seed=0)
    problems[0].prompt, problems[0].answer, problems[0].text  # "Q: What is 237 + 418? A:", 655, "... A: 655."

**Problems.** Five tasks (``TASKS``), each a few *kinds* of question, in varied phrasings:

    arithmetic     add, sub, mul: one operation, operands and result in 0..999
    clock          past, until (the hour), hands (analog), after_midnight, elapsed (between two times),
                   hours_later (on a 12-hour dial)
    units          convert: 16 unit pairs (length, mass, volume, time), both directions
    counting       letters (of a word), letter_count, tally (items in a list), range (whole numbers
                   from a to b), multiples (of k up to n), list_length
    word_problems  give_away, buy_packs, share, shopping, trip, age: two steps each

Every answer is one integer in 0..999, so exact match and absolute error are meaningful and the
answer is a single numeric token of a Llama-3-style tokenizer. The format is fixed:

    prompt = "Q: <question> A:"          the answer slot is right after "A:"
    text   = prompt + " " + str(answer) + "."

``Problem.operands`` is the tuple that, with the task, determines the answer: the kind's name then its
values, e.g. ``("add", 237, 418)``, ``("past", 7, 45)``, ``("convert", "meter", "centimeter", 7)``.
Names, objects and phrasings are drawn freely and are not operands.

**Splits.** Each kind enumerates all its operand tuples. A tuple's *split key* decides its split: the
key is hashed (splitmix64, seeded by the key's *family*) and the tuple is a test tuple when the hash
is 0 modulo ``TEST_MODULUS`` (about 1 in 10), a train tuple otherwise; so no test tuple is ever a
train tuple, at any seed or count. Kinds of one family share keys, which makes the held-out set
stricter than "different operands": a test fact 23 + 45 = 68 is never trained as 45 + 23, 68 - 45 or
68 - 23; a test clock time 7:45 is never trained in any clock question (read, count down, from
midnight, hands); a test quantity "7 meters" is never trained as "700 centimeters"; a test word is
never counted in training. A list of problems holds each operand tuple at most once, spread
evenly over the task's kinds (a kind with fewer tuples than its share gives all it has; the rest go
to the other kinds), so a split can supply as many problems as it has tuples (``split_capacity``).
"""

from __future__ import annotations

import hashlib
import itertools
import random
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterable, Sequence

import numpy as np

TASKS = ("arithmetic", "clock", "units", "counting", "word_problems")
SPLITS = ("train", "test")
# An operand tuple is held out (split "test") when the hash of its split key is 0 modulo this.
TEST_MODULUS = 10
# Problems joined (by newlines) into one training or eval document: about 100 tokens with the tokenizer below.
PROBLEMS_PER_DOCUMENT = 4
MAX_ANSWER = 999


@dataclass(frozen=True)
class Problem:
    """One question with a single integer answer in 0..999.

    task:     one of ``TASKS``.
    prompt:   ``"Q: <question> A:"``; the answer goes right after it.
    answer:   the integer answer, 0..999.
    operands: ``(kind, *values)``: with the task, determines the answer; its split key decides the split.
    """

    task: str
    prompt: str
    answer: int
    operands: tuple

    @property
    def text(self) -> str:
        """The training document for this problem: ``prompt + " " + str(answer) + "."``."""
        return f"{self.prompt} {self.answer}."


# ----------------------------------------------------------------------------------------------
# Word lists (letters only: plain text must hold no digits)
# ----------------------------------------------------------------------------------------------

NAMES = (("Tom", "he"), ("Mia", "she"), ("Sam", "he"), ("Lena", "she"), ("Omar", "he"), ("Ana", "she"),
          ("Ravi", "he"), ("Yuki", "she"), ("Ben", "he"), ("Zoe", "she"), ("Leo", "he"), ("Ivy", "she"),
          ("Noah", "he"), ("Emma", "she"), ("Kofi", "he"), ("Sara", "she"), ("Luis", "he"), ("Nora", "she"))
_OBJECTS = ("pens", "pencils", "stickers", "marbles", "cookies", "apples", "books", "cards", "stamps", "shells",
            "beads", "candies", "toys", "coins", "balloons", "buttons", "eggs", "flowers")
_BAKED = ("muffins", "cookies", "rolls", "buns", "tarts", "pretzels", "bagels", "scones")
_CONTAINERS = ("boxes", "bags", "packs", "crates", "jars", "baskets")
_GOODS = ("notebooks", "pencils", "apples", "tickets", "mugs", "candles", "plates", "shirts", "lamps", "books")
_VEHICLES = ("car", "train", "bus", "truck", "boat", "cyclist")
_RELATIVES = ("mother", "father", "aunt", "uncle", "grandmother", "grandfather")
_TALLIED = (("apple", "apples"), ("pear", "pears"), ("cat", "cats"), ("dog", "dogs"), ("star", "stars"),
            ("cup", "cups"), ("key", "keys"), ("coin", "coins"), ("bird", "birds"), ("hat", "hats"))
# Spelled in the counting task; also the nouns of plain text.
WORDS = tuple("""
apple banana cherry grape lemon melon peach plum mango garden forest river mountain valley ocean island
desert meadow canyon village city castle bridge tower market harbor station library museum school kitchen window
door table chair pillow blanket mirror candle lantern basket bottle kettle teapot saucer spoon fork knife plate
bucket ladder hammer pencil eraser notebook letter envelope stamp parcel ticket wallet pocket jacket sweater
scarf glove boot sandal hat button ribbon thread needle carpet curtain ceiling chimney garage fence gate path
road street avenue tunnel lighthouse sailboat anchor compass map journey traveler stranger neighbor friend
teacher student doctor farmer baker painter poet singer dancer pilot sailor gardener writer reader
rabbit turtle squirrel hedgehog badger otter beaver falcon sparrow pigeon parrot penguin dolphin whale octopus
lobster butterfly beetle spider cricket dragon unicorn tiger lion zebra giraffe elephant monkey panda koala kangaroo
camel donkey horse pony goat sheep cow chicken duck goose swan owl eagle raven robin
thunder lightning rainbow cloud breeze storm snowflake sunshine moonlight starlight shadow whisper echo silence
music melody rhythm story legend puzzle riddle secret treasure promise adventure mystery wonder
happiness kindness courage patience wisdom freedom balance harmony comfort memory dream
""".split())
# ----------------------------------------------------------------------------------------------
# Kinds: the operand tuples of one kind of question, how to ask it, how to solve it
# ----------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Kind:
    """One kind of question of a task.

    name:      the first element of its problems' operands.
    family:    kinds sharing split keys (and so held-out tuples) share a family; it seeds the hash.
    rows:      every operand tuple, integer-coded, as ``[M, width]`` int64.
    solve:     ``Problem.operands`` -> the answer.
    ask:       ``(operands, rng)`` -> the question (names, objects and phrasing drawn from ``rng``).
    decode:    one integer-coded row (a list of ints) -> the operand values after ``name``; ``None``:
               the row's ints themselves.
    split_key: ``[M, width]`` rows -> ``[M, key_width]`` split keys; ``None``: the rows themselves.
    """

    name: str
    family: str
    rows: Callable[[], np.ndarray]
    solve: Callable[[tuple], int]
    ask: Callable[[tuple, random.Random], str]
    decode: Callable[[list], tuple] | None = None
    split_key: Callable[[np.ndarray], np.ndarray] | None = None

    def operands(self, row: list) -> tuple:
        return (self.name, *(row if self.decode is None else self.decode(row)))

    def keys(self, rows: np.ndarray) -> np.ndarray:
        return rows if self.split_key is None else self.split_key(rows)


def _grid(*ranges: Iterable[int], keep: Callable[[np.ndarray], np.ndarray] | None = None) -> np.ndarray:
    """Every combination of the value ``ranges``, as ``[M, len(ranges)]`` int64 rows, those where ``keep(rows)``
    (a ``[M]`` bool mask) is true when it is given."""
    axes = np.meshgrid(*[np.asarray(list(values), dtype=np.int64) for values in ranges], indexing="ij")
    rows = np.stack([axis.ravel() for axis in axes], axis=1)
    return rows if keep is None else rows[keep(rows)]


def _two_products_fit(rows: np.ndarray) -> np.ndarray:
    """Rows (a, b, c, d) with a * b + c * d <= 999."""
    return rows[:, 0] * rows[:, 1] + rows[:, 2] * rows[:, 3] <= MAX_ANSWER


def _sorted_pair(first: np.ndarray, second: np.ndarray) -> np.ndarray:
    return np.sort(np.stack([first, second], axis=1), axis=1)


def _asker(questions: Sequence[str], fields: Callable[[tuple, random.Random], dict]):
    """An ``ask`` that picks one of ``questions`` and fills it with ``fields(operands, rng)``."""
    def ask(operands: tuple, rng: random.Random) -> str:
        question = rng.choice(questions)
        return question.format(**fields(operands, rng))
    return ask


def _fields(*names: str, person: bool = False, **drawn: Sequence[str]):
    """A ``fields`` for ``_asker``: the operand values after the kind's name, called ``names``; with
    ``person``, a person drawn first (``_person``); then one item drawn from each ``drawn`` sequence, in order."""
    def fields(operands: tuple, rng: random.Random) -> dict:
        values = {**(_person(rng) if person else {}), **dict(zip(names, operands[1:]))}
        return {**values, **{key: rng.choice(choices) for key, choices in drawn.items()}}
    return fields


def _plural(count: int, singular: str, plural: str) -> str:
    return f"{count} {singular if count == 1 else plural}"


def _clock(hour: int, minute: int) -> str:
    return f"{hour}:{minute:02d}"


def _next_hour(hour: int) -> int:
    """The hour after ``hour`` on a 12-hour dial (12 -> 1)."""
    return hour % 12 + 1


# --- arithmetic: a + b, a - b, a * b with operands and results in 0..999 -------------------------

_ARITHMETIC = (
    _Kind("add", "additive",
          rows=lambda: _grid(range(1000), range(1000), keep=lambda ab: ab[:, 0] + ab[:, 1] <= MAX_ANSWER),
          solve=lambda operands: operands[1] + operands[2],
          ask=_asker(("What is {a} + {b}?", "Compute {a} plus {b}.", "{a} + {b} = ?",
                      "What is the sum of {a} and {b}?", "Add {a} and {b}."), _fields("a", "b")),
          split_key=lambda rows: _sorted_pair(rows[:, 0], rows[:, 1])),
    # The fact of a - b = c is {b, c}, the fact of c + b: a held-out sum is held out as a difference too.
    _Kind("sub", "additive",
          rows=lambda: _grid(range(1000), range(1000), keep=lambda ab: ab[:, 0] >= ab[:, 1]),
          solve=lambda operands: operands[1] - operands[2],
          ask=_asker(("What is {a} - {b}?", "Compute {a} minus {b}.", "{a} - {b} = ?",
                      "What is {b} subtracted from {a}?", "What is the difference between {a} and {b}?"),
                     _fields("a", "b")),
          split_key=lambda rows: _sorted_pair(rows[:, 0] - rows[:, 1], rows[:, 1])),
    _Kind("mul", "multiplicative",
          rows=lambda: _grid(range(2, 500), range(2, 500), keep=lambda ab: ab[:, 0] * ab[:, 1] <= MAX_ANSWER),
          solve=lambda operands: operands[1] * operands[2],
          ask=_asker(("What is {a} * {b}?", "What is {a} times {b}?", "Compute {a} multiplied by {b}.",
                      "{a} * {b} = ?", "What is the product of {a} and {b}?"), _fields("a", "b")),
          split_key=lambda rows: _sorted_pair(rows[:, 0], rows[:, 1])),
)


# --- clock: reading times on 12- and 24-hour clocks ----------------------------------------------

def _time_fields(operands: tuple, rng: random.Random) -> dict:
    hour, minute = operands[1], operands[2]
    return {"time": _clock(hour, minute), "hour": hour, "next": _next_hour(hour)}


def _hands_fields(operands: tuple, rng: random.Random) -> dict:
    hour, mark = operands[1], operands[2]
    return {"hour": hour, "next": _next_hour(hour), "mark": mark}


def _elapsed_fields(operands: tuple, rng: random.Random) -> dict:
    return {"start": _clock(*operands[1:3]), "end": _clock(*operands[3:5])}


def _hours_later_fields(operands: tuple, rng: random.Random) -> dict:
    return {"hour": operands[1], "later": _plural(operands[2], "hour", "hours")}


def _clock_face_key(rows: np.ndarray) -> np.ndarray:
    """(hour on the 12-hour dial, minute): the key of the "time" family; 13:05 and 1:05 share a face."""
    return np.stack([rows[:, 0] % 12, rows[:, 1]], axis=1)


def _elapsed_rows() -> np.ndarray:
    """Start and end on one day in 5-minute steps, 5..995 minutes apart, as (h1, m1, h2, m2)."""
    starts_ends = _grid(range(0, 24 * 60, 5), range(5, MAX_ANSWER + 1, 5))
    starts_ends[:, 1] += starts_ends[:, 0]
    starts_ends = starts_ends[starts_ends[:, 1] < 24 * 60]
    return np.concatenate([np.stack(np.divmod(starts_ends[:, 0], 60), axis=1),
                           np.stack(np.divmod(starts_ends[:, 1], 60), axis=1)], axis=1)


_CLOCK = (
    _Kind("past", "time",
          rows=lambda: _grid(range(1, 13), range(60)),
          solve=lambda operands: operands[2],
          ask=_asker(("The clock shows {time}. How many minutes past {hour} is it?",
                      "It is {time}. How many minutes past the hour is it?",
                      "A clock reads {time}. How many minutes have passed since {hour} o'clock?"), _time_fields),
          split_key=_clock_face_key),
    _Kind("until", "time",
          rows=lambda: _grid(range(1, 13), range(1, 60)),
          solve=lambda operands: 60 - operands[2],
          ask=_asker(("It is {time}. How many minutes until {next} o'clock?",
                      "The clock shows {time}. How many minutes are left until the next hour?",
                      "A clock reads {time}. In how many minutes will it be {next} o'clock?"), _time_fields),
          split_key=_clock_face_key),
    # Hour hand just past `hour`, minute hand on the dial number `mark` (1..11): the time hour:(5 * mark).
    _Kind("hands", "time",
          rows=lambda: _grid(range(1, 13), range(1, 12)),
          solve=lambda operands: 5 * operands[2],
          ask=_asker(("The hour hand is just past {hour} and the minute hand points at the {mark}. "
                      "How many minutes past the hour is it?",
                      "On a clock the minute hand points at the {mark} and the hour hand is between the {hour} and "
                      "the {next}. How many minutes past {hour} is it?"), _hands_fields),
          split_key=lambda rows: np.stack([rows[:, 0] % 12, 5 * rows[:, 1]], axis=1)),
    _Kind("after_midnight", "time",
          rows=lambda: _grid(range(17), range(60), keep=lambda hm: 60 * hm[:, 0] + hm[:, 1] <= MAX_ANSWER),
          solve=lambda operands: 60 * operands[1] + operands[2],
          ask=_asker(("A 24-hour clock reads {time}. How many minutes after midnight is it?",
                      "It is {time} on a 24-hour clock. What is the time in minutes after midnight?",
                      "How many minutes have passed since midnight when a 24-hour clock shows {time}?"),
                     _time_fields),
          split_key=_clock_face_key),
    _Kind("elapsed", "elapsed",
          rows=_elapsed_rows,
          solve=lambda operands: 60 * (operands[3] - operands[1]) + operands[4] - operands[2],
          ask=_asker(("A movie starts at {start} and ends at {end} the same day. How many minutes long is it?",
                      "A train leaves at {start} and arrives at {end} the same day. How many minutes does the trip "
                      "take?",
                      "A class runs from {start} to {end} on a 24-hour clock. How many minutes is that?"),
                     _elapsed_fields)),
    _Kind("hours_later", "hours_later",
          rows=lambda: _grid(range(1, 13), range(1, 12)),
          solve=lambda operands: (operands[1] + operands[2] - 1) % 12 + 1,
          ask=_asker(("It is {hour} o'clock. What hour will the clock show {later} later?",
                      "A clock shows {hour} o'clock. Which hour will it show {later} from now?"),
                     _hours_later_fields)),
)


# --- units: conversions with integer answers ----------------------------------------------------

# (larger unit, its plural, smaller unit, its plural, smaller units per larger unit)
_UNIT_PAIRS = (
    ("meter", "meters", "centimeter", "centimeters", 100),
    ("centimeter", "centimeters", "millimeter", "millimeters", 10),
    ("kilometer", "kilometers", "meter", "meters", 1000),
    ("kilogram", "kilograms", "gram", "grams", 1000),
    ("liter", "liters", "milliliter", "milliliters", 1000),
    ("hour", "hours", "minute", "minutes", 60),
    ("minute", "minutes", "second", "seconds", 60),
    ("day", "days", "hour", "hours", 24),
    ("week", "weeks", "day", "days", 7),
    ("year", "years", "month", "months", 12),
    ("decade", "decades", "year", "years", 10),
    ("century", "centuries", "year", "years", 100),
    ("foot", "feet", "inch", "inches", 12),
    ("yard", "yards", "foot", "feet", 3),
    ("gallon", "gallons", "quart", "quarts", 4),
    ("pound", "pounds", "ounce", "ounces", 16),
)
_CONVERSION_QUESTIONS = ("How many {to} are in {amount}?", "Convert {amount} to {to}.",
                         "{amount} is how many {to}?", "How many {to} make {amount}?")


def _unit_kinds(large: str, larges: str, small: str, smalls: str, factor: int) -> tuple[_Kind, ...]:
    """Large -> small (answer amount * factor, amounts up to 999 // factor) and small -> large (answer
    1..999); one family keyed by the amount in large units, so "7 meters" and "700 centimeters" share a split."""
    def fields(to: str, one: str, many: str):
        return lambda operands, rng: {"amount": _plural(operands[3], one, many), "to": to}

    kinds = []
    if factor <= MAX_ANSWER:
        kinds.append(_Kind("convert", f"units/{large}", rows=lambda: _grid(range(1, MAX_ANSWER // factor + 1)),
                           decode=lambda row: (large, small, row[0]),
                           solve=lambda operands: operands[3] * factor,
                           ask=_asker(_CONVERSION_QUESTIONS, fields(smalls, large, larges))))
    kinds.append(_Kind("convert", f"units/{large}", rows=lambda: _grid(range(1, MAX_ANSWER + 1)),
                       decode=lambda row: (small, large, row[0] * factor),
                       solve=lambda operands: operands[3] // factor,
                       ask=_asker(_CONVERSION_QUESTIONS, fields(larges, small, smalls))))
    return tuple(kinds)


_UNITS = tuple(kind for pair in _UNIT_PAIRS for kind in _unit_kinds(*pair))


# --- counting: letters, tallies, ranges, multiples, list lengths --------------------------------

_LETTERS = "abcdefghijklmnopqrstuvwxyz"
_SPELLED = tuple(sorted(set(WORDS)))


def _letter_rows() -> np.ndarray:
    """(word index, letter index) for every distinct letter of every spelled word."""
    return np.asarray([(index, _LETTERS.index(letter)) for index, word in enumerate(_SPELLED)
                       for letter in sorted(set(word))], dtype=np.int64)


def _tally_rows() -> np.ndarray:
    """(tallied item, other item, list length 3..10, bitmask of the positions holding the tallied item).
    At least one position holds the other item: a list of tallied items alone is one tuple, not one per other."""
    return np.asarray([(target, other, length, mask)
                       for target, other in itertools.permutations(range(len(_TALLIED)), 2)
                       for length in range(3, 11) for mask in range(2 ** length - 1)], dtype=np.int64)


def _tally_decode(row: list) -> tuple:
    target, other, length, mask = row
    items = tuple(_TALLIED[target if mask >> position & 1 else other][0] for position in range(length))
    return _TALLIED[target][0], items


def _tally_fields(operands: tuple, rng: random.Random) -> dict:
    plural = dict(_TALLIED)[operands[1]]
    return {"items": ", ".join(operands[2]), "plural": plural}


def _progression(start: int, step: int, length: int) -> tuple:
    return tuple(range(start, start + step * length, step))


_COUNTING = (
    _Kind("letters", "words",
          rows=lambda: _grid(range(len(_SPELLED))),
          decode=lambda row: (_SPELLED[row[0]],),
          solve=lambda operands: len(operands[1]),
          ask=_asker(("How many letters are in the word '{word}'?", "Count the letters in '{word}'.",
                      "How long is the word '{word}' in letters?"), _fields("word"))),
    _Kind("letter_count", "words",
          rows=_letter_rows,
          decode=lambda row: (_SPELLED[row[0]], _LETTERS[row[1]]),
          solve=lambda operands: operands[1].count(operands[2]),
          ask=_asker(("How many times does the letter '{letter}' appear in '{word}'?",
                      "Count the letter '{letter}' in the word '{word}'."), _fields("word", "letter")),
          split_key=lambda rows: rows[:, :1]),
    _Kind("tally", "tally",
          rows=_tally_rows,
          decode=_tally_decode,
          solve=lambda operands: operands[2].count(operands[1]),
          ask=_asker(("Count the {plural}: {items}.", "How many {plural} are in this list: {items}?"),
                     _tally_fields)),
    _Kind("range", "range",
          rows=lambda: _grid(range(1000), range(1000),
                             keep=lambda ab: (ab[:, 0] <= ab[:, 1]) & (ab[:, 1] - ab[:, 0] < MAX_ANSWER)),
          solve=lambda operands: operands[2] - operands[1] + 1,
          ask=_asker(("How many whole numbers are there from {a} to {b}, inclusive?",
                      "Counting from {a} to {b}, how many numbers do you say?"), _fields("a", "b"))),
    _Kind("multiples", "multiples",
          rows=lambda: _grid(range(2, 13), range(1, 1000), keep=lambda kn: kn[:, 1] >= kn[:, 0]),
          solve=lambda operands: operands[2] // operands[1],
          ask=_asker(("How many multiples of {k} are there from 1 to {n}?",
                      "How many numbers from 1 to {n} are divisible by {k}?"), _fields("k", "n"))),
    _Kind("list_length", "list_length",
          rows=lambda: _grid(range(100), range(1, 21), range(3, 13)),
          decode=lambda row: (_progression(*row),),
          solve=lambda operands: len(operands[1]),
          ask=_asker(("How many numbers are in the list {items}?", "Count the numbers: {items}."),
                     lambda operands, rng: {"items": ", ".join(map(str, operands[1]))})),
)


# --- word problems: two steps each -------------------------------------------------------------

def _person(rng: random.Random) -> dict:
    name, pronoun = rng.choice(NAMES)
    return {"name": name, "pronoun": pronoun.capitalize(), "possessive": "His" if pronoun == "he" else "Her"}


def _share_rows() -> np.ndarray:
    """(total, sold, boxes) with total - sold split evenly: built from (per box 1..99, boxes 2..12, sold 1..99)."""
    per_box_boxes_sold = _grid(range(1, 100), range(2, 13), range(1, 100))
    total = per_box_boxes_sold[:, 0] * per_box_boxes_sold[:, 1] + per_box_boxes_sold[:, 2]
    rows = np.stack([total, per_box_boxes_sold[:, 2], per_box_boxes_sold[:, 1]], axis=1)
    return rows[total <= MAX_ANSWER]


def _shopping_fields(operands: tuple, rng: random.Random) -> dict:
    first, second = rng.sample(_GOODS, 2)
    return {**_person(rng), "n1": operands[1], "p1": operands[2], "n2": operands[3], "p2": operands[4],
            "first": first, "second": second}


_WORD_PROBLEMS = (
    _Kind("give_away", "give_away",
          rows=lambda: _grid(range(2, 21), range(2, 21), range(1, 400),
                             keep=lambda rows: rows[:, 2] < rows[:, 0] * rows[:, 1]),
          solve=lambda operands: operands[1] * operands[2] - operands[3],
          ask=_asker(("{name} has {groups} {container} with {each} {objects} each. {pronoun} gives away {given} "
                      "{objects}. How many {objects} does {name} have left?",
                      "{name} packs {each} {objects} into each of {groups} {container}, then loses {given} of them. "
                      "How many {objects} are still packed?"),
                     _fields("groups", "each", "given", person=True, container=_CONTAINERS, objects=_OBJECTS))),
    _Kind("buy_packs", "buy_packs",
          rows=lambda: _grid(range(1, 1000), range(2, 10), range(2, 21),
                             keep=lambda rows: rows[:, 0] + rows[:, 1] * rows[:, 2] <= MAX_ANSWER),
          solve=lambda operands: operands[1] + operands[2] * operands[3],
          ask=_asker(("{name} had {start} {objects}. {pronoun} bought {packs} packs of {each} {objects}. "
                      "How many {objects} does {name} have now?",
                      "{name} owns {start} {objects} and gets {packs} more bags with {each} {objects} in each. "
                      "How many {objects} does {name} own in total?"),
                     _fields("start", "packs", "each", person=True, objects=_OBJECTS))),
    _Kind("share", "share",
          rows=_share_rows,
          solve=lambda operands: (operands[1] - operands[2]) // operands[3],
          ask=_asker(("A baker made {total} {objects} and sold {sold} of them. The rest are packed equally into "
                      "{boxes} boxes. How many {objects} are in each box?",
                      "A shop has {total} {objects}. After {sold} are sold, the others are shared equally among "
                      "{boxes} shelves. How many {objects} go on each shelf?"),
                     _fields("total", "sold", "boxes", objects=_BAKED))),
    _Kind("shopping", "shopping",
          rows=lambda: _grid(range(2, 21), range(1, 26), range(2, 21), range(1, 26), keep=_two_products_fit),
          solve=lambda operands: operands[1] * operands[2] + operands[3] * operands[4],
          ask=_asker(("{name} buys {n1} {first} at {p1} dollars each and {n2} {second} at {p2} dollars each. "
                      "How many dollars does {name} spend?",
                      "At a shop {first} cost {p1} dollars each and {second} cost {p2} dollars each. What do {n1} "
                      "{first} and {n2} {second} cost together, in dollars?"), _shopping_fields)),
    _Kind("trip", "trip",
          rows=lambda: _grid(range(10, 100), range(2, 7), range(10, 100), range(2, 7), keep=_two_products_fit),
          solve=lambda operands: operands[1] * operands[2] + operands[3] * operands[4],
          ask=_asker(("A {vehicle} travels at {s1} miles per hour for {t1} hours, then at {s2} miles per hour for "
                      "{t2} hours. How many miles does it travel in total?",
                      "A {vehicle} goes {s1} miles per hour for {t1} hours and {s2} miles per hour for {t2} more "
                      "hours. How far does it go, in miles?"), _fields("s1", "t1", "s2", "t2", vehicle=_VEHICLES))),
    _Kind("age", "age",
          rows=lambda: _grid(range(2, 21), range(2, 10), range(2, 51), keep=lambda rows: rows[:, 0] * rows[:, 1] <= 99),
          solve=lambda operands: operands[1] * operands[2] + operands[3],
          ask=_asker(("{name} is {age} years old. {possessive} {relative} is {times} times as old. How old will "
                      "the {relative} be in {years} years?",
                      "{name} is {age}. {possessive} {relative} is {times} times that age. What age will the "
                      "{relative} be {years} years from now?"),
                     _fields("age", "times", "years", person=True, relative=_RELATIVES))),
)

_KINDS = {"arithmetic": _ARITHMETIC, "clock": _CLOCK, "units": _UNITS, "counting": _COUNTING,
          "word_problems": _WORD_PROBLEMS}


# ----------------------------------------------------------------------------------------------
# Splits and sampling
# ----------------------------------------------------------------------------------------------

def _splitmix64(values: np.ndarray) -> np.ndarray:
    """splitmix64's output function on a uint64 array (wrapping arithmetic: numpy arrays never warn)."""
    values = values + np.uint64(0x9E3779B97F4A7C15)
    values = (values ^ (values >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    values = (values ^ (values >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return values ^ (values >> np.uint64(31))


def _is_test(family: str, keys: np.ndarray) -> np.ndarray:
    """``[M]`` bool: which key rows (``[M, width]`` non-negative ints) are held out. Stable across runs and
    platforms: the hash chains splitmix64 over the columns from a seed taken from the family name."""
    seed = int.from_bytes(hashlib.blake2b(family.encode(), digest_size=8).digest(), "little")
    hashes = np.full(len(keys), seed, dtype=np.uint64)
    for column in keys.T:
        hashes = _splitmix64(hashes ^ column.astype(np.uint64))
    return hashes % np.uint64(TEST_MODULUS) == 0


@lru_cache(maxsize=None)
def _split_rows(task: str, kind_index: int) -> dict:
    """``{"train": rows, "test": rows}``: a kind's operand rows (``[M, width]`` int64) by split; cached."""
    kind = _KINDS[task][kind_index]
    rows = kind.rows()
    held_out = _is_test(kind.family, kind.keys(rows))
    return {"train": rows[~held_out], "test": rows[held_out]}


def _spread(count: int, capacities: list[int]) -> list[int]:
    """``count`` split as evenly as ``capacities`` allow: a kind never gets more than its capacity and
    what it cannot take goes to the others. The caller checks ``count <= sum(capacities)``."""
    taken = [0] * len(capacities)
    remaining = count
    open_kinds = [index for index, capacity in enumerate(capacities) if capacity > 0]
    while remaining and open_kinds:
        share, extra = divmod(remaining, len(open_kinds))
        for position, index in enumerate(open_kinds):
            grant = min(capacities[index] - taken[index], share + (position < extra))
            taken[index] += grant
            remaining -= grant
        open_kinds = [index for index in open_kinds if taken[index] < capacities[index]]
    return taken


def split_capacity(task: str, split: str) -> int:
    """How many distinct problems (operand tuples) ``task`` has in ``split``: the most one call can ask for."""
    _check_task_and_split(task, split)
    return sum(len(_split_rows(task, index)[split]) for index in range(len(_KINDS[task])))


def _check_task_and_split(task: str, split: str) -> None:
    if task not in _KINDS:
        raise ValueError(f"unknown task {task!r}; choose one of {TASKS}")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {SPLITS}")


def check_count(name: str, count) -> None:
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise ValueError(f"{name} must be a non-negative int; got {count!r}")


def generate_problems(task: str, count: int, split: str, seed: int) -> list[Problem]:
    """``count`` distinct problems of ``task`` from ``split`` ("train" or "test"), shuffled.

    The same (task, count, split, seed) gives the same list; another seed another sample. Test and
    train problems never share a split key (module docstring), whatever the seeds and counts.
    Raises ``ValueError`` for an unknown task or split, a negative count, or a count above
    ``split_capacity(task, split)``.
    """
    _check_task_and_split(task, split)
    check_count("count", count)
    kinds = _KINDS[task]
    pools = [_split_rows(task, index)[split] for index in range(len(kinds))]
    capacity = sum(len(pool) for pool in pools)
    if count > capacity:
        raise ValueError(f"count={count} is more than the {capacity} distinct {task!r} problems of the {split!r} "
                         f"split (about 1 in {TEST_MODULUS} operand tuples is held out for 'test'); ask for at "
                         f"most {capacity}")
    rng = random.Random(f"{task}/{split}/{seed}")
    problems = []
    for kind, pool, quota in zip(kinds, pools, _spread(count, [len(pool) for pool in pools])):
        for row_index in rng.sample(range(len(pool)), quota):
            operands = kind.operands(pool[row_index].tolist())
            problems.append(Problem(task, f"Q: {kind.ask(operands, rng)} A:", kind.solve(operands), operands))
    rng.shuffle(problems)
    return problems
