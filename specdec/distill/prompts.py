"""The prompts ``specdec distill`` has the target answer, and the held-out ones it evaluates on.

Built deterministically from task templates x topics, so the set is large and diverse (code,
explanations, lists, how-tos, stories, Q&A, comparisons, multi-turn chat) without shipping a
corpus. Two held-out sets: ``templated`` (topics that never appear in training prompts, in
the training templates and a few more) and ``handwritten`` (48 prompts written by hand, in
phrasings no template produces: casual questions, typos, passages to rewrite or summarize,
code to read, word problems). A draft trained on template prompts scores higher on the first
than on real users' prompts; the second is the honest figure.
"""

from __future__ import annotations

import json
import pathlib
import random

TRAIN_TOPICS = [
    "photosynthesis", "the water cycle", "volcanoes", "black holes", "the immune system",
    "climate change", "the French Revolution", "the printing press", "the Roman Empire",
    "ancient Egypt", "the Industrial Revolution", "democracy", "inflation", "supply and demand",
    "compound interest", "budgeting", "machine learning", "neural networks", "the internet",
    "encryption", "databases", "operating systems", "cloud computing", "open source software",
    "electric cars", "solar power", "wind turbines", "nuclear energy", "recycling", "bees",
    "dolphins", "elephants", "rainforests", "deserts", "coral reefs", "the moon", "Mars",
    "gravity", "magnets", "electricity", "sound waves", "light", "atoms", "DNA", "vaccines",
    "sleep", "nutrition", "exercise", "meditation", "stress", "time management",
    "public speaking", "job interviews", "writing a resume", "learning a language",
    "playing guitar", "painting", "photography", "gardening", "baking bread", "making coffee",
    "cooking pasta", "camping", "hiking", "running a marathon", "chess", "soccer",
    "basketball", "the Olympics", "friendship", "kindness", "honesty", "teamwork",
    "leadership", "starting a small business", "marketing", "customer service",
    "negotiation", "email etiquette", "remote work", "smartphones", "social media",
    "video games", "movies", "music theory", "jazz", "poetry", "Shakespeare", "libraries",
    "museums", "trains", "airplanes", "bridges", "skyscrapers", "cities", "farming",
    "weather forecasting", "earthquakes", "oceans", "rivers", "mountains", "dinosaurs",
    "evolution", "the human heart", "the brain", "bones", "teeth", "cats", "dogs",
    "horses", "birds", "butterflies", "ants", "trees", "flowers", "mushrooms", "tea",
    "chocolate", "cheese", "rice", "maps", "compasses", "clocks", "calendars", "money",
    "banks", "taxes", "voting", "laws", "courts", "newspapers", "radio", "television",
    "robots", "3D printing", "batteries", "recycling plastic", "water purification",
    "first aid", "fire safety", "road safety", "a birthday party", "a wedding", "moving house",
    "a rainy day", "a lost key", "a city at night", "a small village", "a lighthouse",
    "a dragon", "a robot who learns to paint", "a time traveler", "a pirate ship",
]

HELD_OUT_TOPICS = [
    "glaciers", "octopuses", "the Silk Road", "origami", "beekeeping", "submarines",
    "the periodic table", "telescopes", "knitting", "kites", "the stock market",
    "penguins", "caves", "the Great Wall of China", "yoga", "pottery", "windmills",
    "hot air balloons", "sourdough", "password managers", "spreadsheets", "a haunted house",
    "a snowstorm", "a talking tree", "the Renaissance", "tides", "comets", "hedgehogs",
    "board games", "violins",
]

CODE_TASKS = [
    "Write a Python function that reverses a string.",
    "Write a Python function that checks whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python function that counts the vowels in a string.",
    "Write a Python function that removes duplicates from a list while keeping order.",
    "Write a Python function that merges two sorted lists.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a Python function that computes the factorial of a number.",
    "Write a Python script that reads a text file and prints the number of lines.",
    "Write a Python function that finds the largest element in a list.",
    "Write a JavaScript function that capitalizes the first letter of each word.",
    "Write a SQL query that selects all users older than 30 from a table called users.",
    "Explain what a Python list comprehension is, with an example.",
    "Explain the difference between a list and a tuple in Python.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Write a bash command that counts the files in a directory.",
    "Write a Python function that converts Celsius to Fahrenheit.",
    "Explain what recursion is and give a short Python example.",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Explain what a REST API is.",
    "Write a Python function that flattens a nested list.",
    "Write a Python function that returns the most common word in a sentence.",
    "Explain what Git is and how to make a commit.",
    "Write a Python function that computes the average of a list of numbers.",
]

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Give me three interesting facts about {t}.",
    "Write a short story about {t}.",
    "Write a short poem about {t}.",
    "List five things everyone should know about {t}.",
    "How does {t} work?",
    "Why is {t} important?",
    "Explain {t} to a ten-year-old.",
    "Write a paragraph about the history of {t}.",
    "What are the pros and cons of {t}?",
    "Give me a step-by-step guide to getting started with {t}.",
    "Summarize the main ideas behind {t} in a few sentences.",
    "What are common misconceptions about {t}?",
    "Write a short blog post introduction about {t}.",
    "Describe {t} in three sentences.",
    "What questions would a student ask about {t}? Answer two of them.",
    "Write a haiku about {t}.",
    "Compare {t} with something from everyday life.",
    "Give me some tips related to {t}.",
    "Write a friendly email to a colleague about {t}.",
    "What would the world be like without {t}?",
    "Write a dialogue between two friends talking about {t}.",
    "Create a short quiz with three questions about {t}.",
]

# A wider topic and phrasing set for drafts built with more data (``prompt_set="wide"``);
# none of these appear in the held-out lists below.
WIDE_TOPICS = [
    "quantum computing", "the stock exchange of a small town", "coffee farming", "tea ceremonies",
    "the Amazon river", "the Sahara", "Antarctica", "the Arctic", "polar bears", "wolves",
    "owls", "sharks", "whales", "frogs", "snakes", "spiders", "honey", "apples", "bananas",
    "potatoes", "tomatoes", "spices", "soup", "pizza", "sushi", "tacos", "salad", "breakfast",
    "vegetarian cooking", "fermentation", "food safety", "kitchen knives", "cast iron pans",
    "bicycles", "motorcycles", "sailing", "rowing", "swimming", "tennis", "golf", "cricket",
    "baseball", "skiing", "surfing", "rock climbing", "pilates", "stretching",
    "posture", "hydration", "the common cold", "allergies", "headaches", "eyesight", "hearing",
    "the lungs", "the stomach", "muscles", "the skin", "hormones", "blood", "antibiotics",
    "hand washing", "mental health", "loneliness", "habits", "motivation", "procrastination",
    "focus", "note taking", "studying for exams", "reading books", "speed reading",
    "memory techniques", "critical thinking", "logic puzzles", "riddles", "probability",
    "statistics", "algebra", "geometry", "fractions", "prime numbers", "infinity", "calculus",
    "graphs and charts", "word processors", "typing", "keyboards", "computer mice",
    "monitors", "laptops", "tablets", "printers", "Wi-Fi", "Bluetooth", "GPS", "satellites",
    "rockets", "the International Space Station", "astronauts", "Jupiter", "Saturn", "Venus",
    "the sun", "stars", "galaxies", "eclipses", "meteor showers", "the seasons", "clouds",
    "rainbows", "lightning", "hurricanes", "tornadoes", "floods", "droughts", "wildfires",
    "air pollution", "composting", "zero waste living", "public transport", "traffic",
    "parking", "electric scooters", "self-driving cars", "ships", "ports", "canals", "tunnels",
    "roads", "architecture", "castles", "pyramids", "temples", "gardens", "parks", "zoos",
    "aquariums", "circuses", "theaters", "opera", "ballet", "hip hop", "rock music",
    "classical music", "pianos", "drums", "singing", "songwriting", "film making", "animation",
    "comic books", "novels", "fairy tales", "myths", "legends", "detective stories",
    "science fiction", "fantasy worlds", "a space station", "a magic library", "a lost cat",
    "a brave knight", "a secret garden", "a friendly ghost", "an old map", "a treasure hunt",
    "a mystery on a train", "a robot chef", "a talking dog", "a tiny dragon", "a storm at sea",
    "a school trip", "a first day at work", "a family dinner", "a surprise gift", "a road trip",
    "a picnic", "a festival", "a market", "a bakery", "a bookshop", "a hospital", "a farm",
    "an island", "a forest", "a mountain village", "a desert oasis", "the future of work",
    "artificial intelligence", "chatbots", "privacy online", "passwords", "phishing",
    "computer viruses", "backups", "version control", "unit testing", "debugging",
    "algorithms", "sorting algorithms", "binary search", "data structures", "hash tables",
    "linked lists", "recursion", "APIs", "web browsers", "HTML", "CSS", "JavaScript",
    "Python", "Linux", "the command line", "containers", "microservices", "networking",
    "IP addresses", "DNS", "email", "spam", "online shopping", "credit cards", "saving money",
    "investing", "insurance", "renting an apartment", "buying a car", "negotiating a salary",
    "career changes", "volunteering", "charity", "community gardens", "neighbors", "manners",
    "gratitude", "patience", "curiosity", "creativity", "failure", "success", "happiness",
    "empathy", "conflict resolution", "parenting", "grandparents", "pets", "houseplants",
    "cleaning", "laundry", "cooking for one", "hosting guests", "traveling abroad",
    "packing a suitcase", "jet lag", "learning to swim", "learning to drive", "first jobs",
]

WIDE_TEMPLATES = [
    "Can you explain {t} briefly?",
    "Write a short introduction to {t} for beginners.",
    "What is the most important thing to understand about {t}?",
    "Give me two examples that show how {t} works.",
    "Write a short, funny story involving {t}.",
    "What are the main challenges of {t}?",
    "Describe a typical day involving {t}.",
    "Explain the basics of {t} in a numbered list.",
    "Write a short speech about {t}.",
    "What advice would an expert give about {t}?",
    "How has {t} changed over time?",
    "Write a product description inspired by {t}.",
    "Give me a fun fact about {t} and explain it.",
    "Write a short letter to a friend describing {t}.",
    "What are some good questions to ask about {t}?",
    "Explain {t} using an analogy.",
]

# Used only for held-out prompts, so the evaluation also sees unseen phrasings.
HELD_OUT_TEMPLATES = [
    "Tell me about {t}.",
    "I am curious about {t}. Where should I start?",
    "Write a limerick about {t}.",
    "What are three surprising things about {t}?",
]

FOLLOW_UPS = [
    "Can you explain that more simply?",
    "Can you give me an example?",
    "Thanks! Can you summarize that in one sentence?",
    "What else should I know?",
    "Can you make it shorter?",
    "Why is that?",
]

SYSTEM_PROMPTS = [
    None,
    None,
    None,
    "You are a concise assistant. Answer briefly.",
    "You are a friendly teacher who explains things clearly.",
]


def _conversations(
    topics: list[str], templates: list[str], n: int, seed: int, with_code: bool
) -> list[list[dict]]:
    rng = random.Random(seed)
    pairs = [(tpl, topic) for tpl in templates for topic in topics]
    rng.shuffle(pairs)
    convs: list[list[dict]] = []
    code = list(CODE_TASKS) if with_code else []
    for i in range(n):
        if code and i % 6 == 5:
            first = code[(i // 6) % len(code)]
        else:
            tpl, topic = pairs[i % len(pairs)]
            first = tpl.format(t=topic)
        messages = []
        system = SYSTEM_PROMPTS[rng.randrange(len(SYSTEM_PROMPTS))]
        if system:
            messages.append({"role": "system", "content": system})
        messages.append({"role": "user", "content": first})
        convs.append(messages)
    return convs


def train_conversations(n: int = 1200, seed: int = 0, prompt_set: str = "base") -> list[list[dict]]:
    """n single-turn chat prompts over the training topics and code tasks.

    ``prompt_set="wide"`` adds WIDE_TOPICS and WIDE_TEMPLATES (about 16k distinct prompts
    instead of 3.7k), for builds with more data than the base set can feed. ``"real"`` makes
    half of them from real text instead (``realtext``: the standard library's documentation
    and code under varied, often casual, instructions).
    """
    if prompt_set == "base":
        return _conversations(TRAIN_TOPICS, TEMPLATES, n, seed, with_code=True)
    if prompt_set == "wide":
        return _conversations(TRAIN_TOPICS + WIDE_TOPICS, TEMPLATES + WIDE_TEMPLATES, n, seed,
                              with_code=True)
    if prompt_set == "real":
        from specdec.distill.realtext import real_text_prompts

        convs = train_conversations(n - n // 2, seed, "wide")
        convs += [[{"role": "user", "content": p}] for p in real_text_prompts(n // 2, seed)]
        random.Random(seed).shuffle(convs)
        return convs
    raise ValueError(f"unknown prompt set {prompt_set!r} (base, wide or real)")


def held_out_conversations(n: int = 48, seed: int = 1) -> list[list[dict]]:
    """Chat prompts on topics that no training prompt mentions."""
    return _conversations(
        HELD_OUT_TOPICS, TEMPLATES + HELD_OUT_TEMPLATES, n, seed, with_code=False
    )


HANDWRITTEN_FILE = pathlib.Path(__file__).resolve().parent.parent / "assets" / "prompts" / \
    "heldout_handwritten.jsonl"
HELD_OUT_SETS = ("templated", "handwritten")


def handwritten_conversations(n: int = 48) -> list[list[dict]]:
    """The first n handwritten held-out prompts, as single-turn chats."""
    lines = HANDWRITTEN_FILE.read_text(encoding="utf-8").splitlines()
    prompts = [json.loads(line)["prompt"] for line in lines if line.strip()]
    return [[{"role": "user", "content": p}] for p in prompts[:n]]


def held_out_set(name: str, n: int = 48) -> list[list[dict]]:
    """A held-out set by name (HELD_OUT_SETS)."""
    if name == "templated":
        return held_out_conversations(n)
    if name == "handwritten":
        return handwritten_conversations(n)
    raise ValueError(f"unknown held-out set {name!r} (one of {', '.join(HELD_OUT_SETS)})")


def follow_up(rng: random.Random) -> str:
    """A second user turn for multi-turn samples."""
    return FOLLOW_UPS[rng.randrange(len(FOLLOW_UPS))]
