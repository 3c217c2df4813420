"""General chat prompts for the chat-trained EAGLE3 draft: instructions, questions, short essays, code; no JSON.

The draft users have is trained on general chat answers, never on JSON. These prompts stand for that data: task
templates (explain, list, compare, write an essay / story / email, answer a question, write code) crossed with topic
pools, drawn deterministically with a seed. None asks for JSON, a schema or a tool call (checked by the unit test).

* :func:`chat_training_requests` -- ``n`` training prompts (``seed``), each unique.
* :func:`chat_held_apart_requests` -- free-text evaluation prompts whose topics and coding tasks never occur in the
  training pools (same templates, so the draft is judged on the style it learned, not on words it saw).

Invariant: the held-apart topic and code pools are disjoint from the training pools, so no held-apart user message is
a training one.
"""

from __future__ import annotations

import random

from sglang_eo_dev.real_model.prompts import Request

__all__ = ["CHAT_TOPICS", "CODE_TASKS", "H_CHAT_TOPICS", "H_CODE_TASKS", "chat_training_requests",
           "chat_held_apart_requests"]

CHAT_TOPICS = (
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the human heart", "vaccines", "climate change",
    "electric cars", "solar panels", "wind power", "the internet", "email etiquette", "public speaking",
    "time management", "learning a new language", "meditation", "healthy breakfast", "drinking enough water",
    "running a marathon", "yoga", "gardening", "composting", "keeping houseplants alive", "adopting a dog",
    "caring for a cat", "birdwatching", "the Roman Empire", "the printing press", "the industrial revolution",
    "ancient Egypt", "the moon landing", "the French Revolution", "the Silk Road", "the Renaissance",
    "saving money", "budgeting for students", "credit scores", "starting a small business", "job interviews",
    "writing a resume", "remote work", "team meetings", "giving feedback", "negotiating a salary",
    "baking bread", "making pasta from scratch", "brewing coffee", "grilling vegetables", "meal planning",
    "reducing food waste", "travelling on a budget", "packing light", "jet lag", "camping in the mountains",
    "visiting museums", "learning to swim", "playing chess", "learning the guitar", "photography for beginners",
    "reading more books", "keeping a journal", "writing poetry", "the history of jazz", "classical music",
    "recycling plastic", "ocean pollution", "bees and pollination", "rainforests", "earthquakes", "tides",
    "the seasons", "rainbows", "lightning", "snowflakes", "the immune system", "sleep and memory", "stress",
    "friendship", "moving to a new city", "raising teenagers", "teaching children to read", "online safety",
    "strong passwords", "cloud computing", "machine learning", "databases", "version control", "open source",
    "smartphones", "video games", "3D printing", "robots in factories", "space exploration", "Mars rovers",
    "the periodic table", "magnets", "gravity", "the speed of light", "prime numbers", "fractions", "probability",
    "statistics in daily life", "maps and navigation", "the Olympic Games", "football tactics", "team sports",
)

CODE_TASKS = (
    "reverses a string", "checks whether a number is prime", "computes the factorial of n",
    "returns the n-th Fibonacci number", "counts the vowels in a sentence", "finds the largest element of a list",
    "removes duplicates from a list while keeping order", "checks whether a word is a palindrome",
    "merges two sorted lists", "computes the average of a list of numbers", "converts Celsius to Fahrenheit",
    "counts word frequencies in a text", "flattens a nested list", "returns the second largest number in a list",
    "checks whether two strings are anagrams", "sums the digits of an integer", "finds the greatest common divisor",
    "capitalizes the first letter of every word", "implements binary search", "sorts a list with bubble sort",
    "reads a text file and counts its lines", "validates a simple email address", "rotates a list by k positions",
    "returns the intersection of two lists", "converts a decimal number to binary",
)

_LANGS = ("Python", "Python", "Python", "JavaScript", "Go", "C")

_TEMPLATES = (
    "Explain {t} in simple terms.",
    "Give me three tips about {t}.",
    "Write a short essay about {t}.",
    "What are the most important facts about {t}?",
    "Describe {t} to a ten-year-old.",
    "What are the pros and cons of {t}?",
    "Write a short story that involves {t}.",
    "Summarize the main ideas behind {t} in a paragraph.",
    "What do people often get wrong about {t}?",
    "Write a friendly email to a colleague about {t}.",
    "List five questions a beginner might ask about {t}, with short answers.",
    "Why does {t} matter?",
    "Write a short poem about {t}.",
    "How would you teach {t} in a one-hour class?",
    "Compare {t} and {u}.",
)

_CODE_TEMPLATES = (
    "Write a {lang} function that {c}.",
    "Show me how to write a {lang} function that {c}, and explain it briefly.",
    "Write a {lang} program that {c}, with a short example.",
)

# Held-apart pools: no topic or coding task here occurs in the training pools above.
H_CHAT_TOPICS = ("coral reefs", "the Great Wall of China", "hiking safety", "learning to paint", "sourdough starters",
                 "the stock market", "first aid", "electric bicycles", "northern lights", "recycling electronics",
                 "the Byzantine Empire", "home insulation")
H_CODE_TASKS = ("returns the longest word in a sentence", "checks whether a year is a leap year",
                "transposes a matrix", "counts the uppercase letters in a string")


def _prompt(rng: random.Random, topics: tuple, code: tuple) -> str:
    if rng.random() < 0.2:
        return rng.choice(_CODE_TEMPLATES).format(lang=rng.choice(_LANGS), c=rng.choice(code))
    t, u = rng.sample(topics, 2)
    return rng.choice(_TEMPLATES).format(t=t, u=u)


def _draw(n: int, seed: int, topics: tuple, code: tuple) -> list[Request]:
    """``n`` distinct prompts from the given pools, drawn with ``seed`` (a prefix of a larger draw)."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out: list[Request] = []
    while len(out) < n:
        p = _prompt(rng, topics, code)
        if p not in seen:
            seen.add(p)
            out.append(Request(p))
    return out


def chat_training_requests(n: int, seed: int = 0) -> list[Request]:
    """``n`` distinct free-text training prompts, drawn with ``seed`` (a prefix of a larger draw with the same seed)."""
    return _draw(n, seed, CHAT_TOPICS, CODE_TASKS)


def chat_held_apart_requests(n: int = 12, seed: int = 4321) -> list[Request]:
    """``n`` free-text evaluation prompts from the held-apart pools (distinct, deterministic)."""
    return _draw(n, seed, H_CHAT_TOPICS, H_CODE_TASKS)
