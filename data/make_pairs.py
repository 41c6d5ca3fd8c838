#!/usr/bin/env python3
"""Generate synthetic preference pairs for reward-model training.

    python data/make_pairs.py            # writes data/pairs-train.jsonl and data/pairs-heldout.jsonl

Each row is {"prompt", "chosen", "rejected"}. Prompts come from seeded reasoning-gym generators
(Apache-2.0) plus hand-written templates (ours). The chosen side is a helpful, on-topic, correctly
formatted answer (reasoning-gym's reference answer, phrased in varied ways). The rejected side is one
of several failure modes (see REJECT_WEIGHTS):

    off_topic   a fluent answer to a different question
    refusal     an evasive / refusing reply
    rude        a dismissive or insulting reply (sometimes still containing the right answer)
    ramble      a rambling non-answer, or a reply truncated before it reaches the answer
    format      the right answer, but ignoring the format the prompt asked for
    lazy_copy   echoes the question or returns the input unchanged instead of doing the task
    wrong_fact  a confident but wrong fact (hand-written factual prompts only)

Deterministic: fixed seeds everywhere, no set/dict iteration over hashed strings, so running it twice
gives byte-identical files (independent of PYTHONHASHSEED).

`build()` returns the rows together with their failure mode, for analysis scripts.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import reasoning_gym as rg

from rg_helpers import chain_steps, literal  # data/ is sys.path[0] when run as a script

HERE = Path(__file__).resolve().parent
SEED = 20250601
N_TRAIN = 3000
N_HELDOUT = 400
# Keep prompt + response short (<= ~64 BERT tokens): a 128-token cross-encoder never truncates, and a
# reward-model step stays cheap on a 2-core CPU.
CHAR_BUDGET = 210

# --------------------------------------------------------------------------------------------
# reasoning-gym tasks
# --------------------------------------------------------------------------------------------
# (name, config overrides, format kind of the built-in question)
#   fmt: None     -> free-form question; we may append our own format instruction
#        "strict" -> the question already demands a bare answer ("Give only ...")
#        "list"   -> the question demands a specific list format
#        "pattern"-> the question demands a specific notation (HH:MM, a × b, ...)
RG_TASKS = [
    ("basic_arithmetic", dict(min_terms=2, max_terms=4, max_digits=3), None),
    ("chain_sum", dict(min_terms=2, max_terms=5, max_digits=3), None),
    ("spell_backward", dict(min_word_len=3, max_word_len=10), None),
    ("gsm_symbolic", dict(), None),
    ("letter_counting", dict(min_words=3, max_words=6), None),
    ("word_sorting", dict(min_words=3, max_words=5, max_word_length=9), "list"),
    ("gcd", dict(), "strict"),
    ("lcm", dict(), None),
    ("caesar_cipher", dict(min_words=2, max_words=5), "strict"),
    ("word_sequence_reversal", dict(min_words=3, max_words=5), "list"),
    ("leg_counting", dict(min_animals=2, max_animals=3, max_instances=12), None),
    ("fraction_simplification", dict(styles=("plain",)), "strict"),
    ("simple_equations", dict(), None),
    ("prime_factorization", dict(), "pattern"),
    ("calendar_arithmetic", dict(tasks=["weekday_of_date", "is_leap_year", "weekday_offset"]), "strict"),
    ("count_bits", dict(max_n=100000), None),
    ("family_relationships", dict(min_family_size=4, max_family_size=4), "strict"),
    ("time_intervals", dict(task_types=["time", "time_seconds"]), "pattern"),
    ("coin_flip", dict(min_trials=3, max_trials=8), None),
    ("base_conversion", dict(max_value=500), None),
]

TOPIC = {
    "basic_arithmetic": "math", "chain_sum": "math", "gsm_symbolic": "math word problems",
    "spell_backward": "spelling games", "letter_counting": "letter counting", "word_sorting": "word sorting",
    "gcd": "number theory", "lcm": "number theory", "caesar_cipher": "cipher puzzles",
    "word_sequence_reversal": "word puzzles", "leg_counting": "counting puzzles",
    "fraction_simplification": "fractions", "simple_equations": "algebra",
    "prime_factorization": "number theory", "calendar_arithmetic": "calendar questions",
    "count_bits": "binary arithmetic", "family_relationships": "family trees", "time_intervals": "time math",
    "coin_flip": "probability", "base_conversion": "base conversion",
    "capital": "geography", "element": "chemistry", "antonym": "vocabulary", "translate": "translation",
    "author": "literature", "define": "vocabulary", "legs": "biology", "howto": "everyday tasks",
    "units": "unit conversion", "parity": "math",
}



def _item(kind, prompt, answer, fmt, sentences, worked=(), copy=None, wrong=None, restates=True, family=None):
    return dict(
        kind=kind,
        family=family or kind,
        base=prompt.strip(),
        answer=str(answer),
        fmt=fmt,
        sentences=[s for s in sentences if s],
        worked=[w for w in worked if w],
        copy=copy,
        wrong=wrong,
        restates=restates,
    )



def shorten(name, q, m):
    """Condense reasoning-gym's boilerplate preambles; the task and the requested format stay the same."""
    if name == "word_sorting":
        words = ", ".join(literal(m["original_words"]))
        return f"Sort these words in {m['direction']} ASCII/Unicode order and return them as a comma-separated list: {words}"
    if name == "word_sequence_reversal":
        return f"Reverse this list of words and answer as a comma-separated list: {', '.join(literal(m['words']))}"
    if name == "leg_counting":
        return q[q.index("how many legs"):].strip().capitalize()
    if name == "base_conversion":
        q = q.split("Now, ")[-1].strip()
        q = q[0].upper() + q[1:] + "."
        if "base-1" in q.split(" to ")[-1] or "hexadecimal" in q.split(" to ")[-1]:
            q += " Use lowercase letters for digits above 9."
        return q
    if name == "prime_factorization":
        return q.replace("Write the factors separated by × (Example: for 12 the answer would be: 2 × 2 × 3)",
                         "Write the factors separated by ×, e.g. 2 × 2 × 3.")
    if name == "gsm_symbolic":
        return q.replace(" Give the result as your final answer. Do not include units.", "")
    return q


def rg_item(name, fmt, it):
    q, a, m = it["question"], str(it["answer"]), it["metadata"]
    q = shorten(name, q, m)
    if name in ("basic_arithmetic", "chain_sum"):
        expr = m["expression"]
        worked = []
        steps, val = chain_steps(expr)
        if steps and len(steps) > 1 and str(val) == a:
            worked.append("Working left to right: " + ", then ".join(steps) + f". So the answer is {a}.")
        worked.append(f"Following the usual order of operations, {expr} evaluates to {a}.")
        return _item(name, q, a, fmt, [f"{expr} = {a}", f"The result of {expr} is {a}.", f"{expr} comes out to {a}."],
                     worked, family="arith")
    if name == "spell_backward":
        w = m["word"]
        return _item(name, q, a, fmt, [f'Spelled backward, "{w}" is "{a}".', f'"{w}" reversed is "{a}".',
                                       f"{a} (that's {w} read from right to left)"],
                     [f'Reading "{w}" from the last letter to the first gives: {" ".join(a)}. Put together, that is "{a}".'],
                     copy=w)
    if name == "gsm_symbolic":
        cot = m.get("answer_cot", "")
        cot = re.sub(r"\n?#### .*$", "", cot).strip()
        worked = [cot + f"\nThe final answer is {a}."] if cot and len(cot) < 120 else []
        return _item(name, q, a, fmt, [f"The final answer is {a}.", f"{a}"], worked, restates=False)
    if name == "letter_counting":
        letter = m["target_letter"]
        times = "time" if a == "1" else "times"
        occ = "occurrence" if a == "1" else "occurrences"
        return _item(name, q, a, fmt, [f'The letter "{letter}" appears {a} {times} in that text.',
                                       f'There {"is" if a == "1" else "are"} {a} {occ} of "{letter}".',
                                       f'"{letter}" shows up {a} {times}.'])
    if name == "word_sorting":
        orig = literal(m["original_words"])
        return _item(name, q, a, fmt, [a], copy=", ".join(orig), family="wordlist")
    if name == "gcd":
        nums = ", ".join(str(x) for x in literal(m["numbers"]))
        return _item(name, q, a, fmt, [f"The greatest common divisor of {nums} is {a}."], family="gcdlcm")
    if name == "lcm":
        nums = " and ".join(str(x) for x in literal(m["numbers"]))
        return _item(name, q, a, fmt, [f"The least common multiple of {nums} is {a}.", f"LCM({nums.replace(' and', ',')}) = {a}",
                                       f"The smallest number divisible by both {nums} is {a}."], family="gcdlcm")
    if name == "caesar_cipher":
        return _item(name, q, a, fmt, [f'The decrypted message reads: "{a}".'], copy=m["cipher_text"])
    if name == "word_sequence_reversal":
        words = literal(m["words"])
        return _item(name, q, a, fmt, [a], copy=", ".join(words), family="wordlist")
    if name == "leg_counting":
        animals = literal(m["animals"])
        desc = ", ".join(f"{n} {k}s" for k, n in animals.items())
        return _item(name, q, a, fmt, [f"There are {a} legs in total.", f"All together, {desc} have {a} legs.",
                                       f"The total number of legs is {a}."])
    if name == "fraction_simplification":
        return _item(name, q, a, fmt, [f"In lowest terms the fraction is {a}."])
    if name == "simple_equations":
        v = m["variable"]
        return _item(name, q, a, fmt, [f"{v} = {a}", f"Solving {m['equation']} gives {v} = {a}.",
                                       f"The solution is {v} = {a}."], family="arith")
    if name == "prime_factorization":
        return _item(name, q, a, fmt, [f"The prime factorization is {a}."])
    if name == "calendar_arithmetic":
        return _item(name, q, a, fmt, [f"The answer is {a}."], restates=False)
    if name == "count_bits":
        n = m["number"]
        return _item(name, q, a, fmt, [f"{n} has {a} one-bits in binary.", f"In binary, {n} is {m['binary']}, which contains {a} ones.",
                                       f"The binary form of {n} has {a} bits set."])
    if name == "family_relationships":
        return _item(name, q, a, fmt, [f"{m['person1']} is {m['person2']}'s {a}."])
    if name == "time_intervals":
        return _item(name, q, a, fmt, [f"The duration is {a}."], restates=False)
    if name == "coin_flip":
        return _item(name, q, a, fmt, [f"The probability is {a}.", f"It comes out to {a}."], restates=False)
    if name == "base_conversion":
        return _item(name, q, a, fmt, [f"The converted number is {a}.", f"In the target base it is written {a}."],
                     restates=False)
    raise KeyError(name)


def rg_pool(seed_base, per_task, exclude):
    items = []
    for ti, (name, cfg, fmt) in enumerate(RG_TASKS):
        ds = rg.create_dataset(name, seed=seed_base + ti, size=per_task * 10, **cfg)
        got = 0
        seen = []
        for i in range(len(ds)):
            if got >= per_task:
                break
            item = rg_item(name, fmt, ds[i])
            q = item["base"]
            if q in exclude or q in seen or len(q) > 150:
                continue
            seen.append(q)
            items.append(item)
            got += 1
    return items


# --------------------------------------------------------------------------------------------
# hand-written templates (ours)
# --------------------------------------------------------------------------------------------
CAPITALS = [
    ("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Portugal", "Lisbon"),
    ("Japan", "Tokyo"), ("China", "Beijing"), ("India", "New Delhi"), ("Canada", "Ottawa"), ("Australia", "Canberra"),
    ("Brazil", "Brasília"), ("Argentina", "Buenos Aires"), ("Mexico", "Mexico City"), ("Egypt", "Cairo"),
    ("Kenya", "Nairobi"), ("Nigeria", "Abuja"), ("Russia", "Moscow"), ("Poland", "Warsaw"), ("Sweden", "Stockholm"),
    ("Norway", "Oslo"), ("Finland", "Helsinki"), ("Denmark", "Copenhagen"), ("Greece", "Athens"), ("Turkey", "Ankara"),
    ("Ireland", "Dublin"), ("Austria", "Vienna"), ("Hungary", "Budapest"), ("Czechia", "Prague"),
    ("Netherlands", "Amsterdam"), ("Belgium", "Brussels"), ("Switzerland", "Bern"), ("Peru", "Lima"),
    ("Chile", "Santiago"), ("Colombia", "Bogotá"), ("Venezuela", "Caracas"), ("Cuba", "Havana"),
    ("South Korea", "Seoul"), ("Thailand", "Bangkok"), ("Vietnam", "Hanoi"), ("Indonesia", "Jakarta"),
    ("Philippines", "Manila"), ("Pakistan", "Islamabad"), ("Iran", "Tehran"), ("Iraq", "Baghdad"),
    ("Saudi Arabia", "Riyadh"), ("Israel", "Jerusalem"), ("Morocco", "Rabat"), ("Ethiopia", "Addis Ababa"),
    ("Ghana", "Accra"), ("South Africa", "Pretoria"), ("New Zealand", "Wellington"), ("Ukraine", "Kyiv"),
    ("Romania", "Bucharest"), ("Bulgaria", "Sofia"), ("Serbia", "Belgrade"), ("Croatia", "Zagreb"),
    ("Iceland", "Reykjavík"), ("Mongolia", "Ulaanbaatar"), ("Nepal", "Kathmandu"), ("Bangladesh", "Dhaka"),
    ("Malaysia", "Kuala Lumpur"), ("Singapore", "Singapore"), ("Algeria", "Algiers"), ("Tunisia", "Tunis"),
    ("Senegal", "Dakar"), ("Uruguay", "Montevideo"), ("Ecuador", "Quito"), ("Bolivia", "Sucre"),
    ("Jamaica", "Kingston"), ("United Kingdom", "London"), ("United States", "Washington, D.C."),
]
ELEMENTS = [
    ("hydrogen", "H"), ("helium", "He"), ("lithium", "Li"), ("carbon", "C"), ("nitrogen", "N"), ("oxygen", "O"),
    ("fluorine", "F"), ("neon", "Ne"), ("sodium", "Na"), ("magnesium", "Mg"), ("aluminium", "Al"), ("silicon", "Si"),
    ("phosphorus", "P"), ("sulfur", "S"), ("chlorine", "Cl"), ("argon", "Ar"), ("potassium", "K"), ("calcium", "Ca"),
    ("iron", "Fe"), ("copper", "Cu"), ("zinc", "Zn"), ("silver", "Ag"), ("gold", "Au"), ("tin", "Sn"),
    ("lead", "Pb"), ("mercury", "Hg"), ("uranium", "U"), ("nickel", "Ni"), ("cobalt", "Co"), ("platinum", "Pt"),
    ("iodine", "I"), ("tungsten", "W"), ("titanium", "Ti"), ("chromium", "Cr"), ("manganese", "Mn"),
]
ANTONYMS = [
    ("hot", "cold"), ("big", "small"), ("fast", "slow"), ("happy", "sad"), ("light", "dark"), ("early", "late"),
    ("open", "closed"), ("full", "empty"), ("strong", "weak"), ("rich", "poor"), ("young", "old"), ("hard", "soft"),
    ("up", "down"), ("inside", "outside"), ("begin", "end"), ("win", "lose"), ("buy", "sell"), ("push", "pull"),
    ("accept", "reject"), ("ancient", "modern"), ("brave", "cowardly"), ("generous", "stingy"), ("noisy", "quiet"),
    ("wet", "dry"), ("thick", "thin"), ("heavy", "light"), ("arrive", "depart"), ("always", "never"),
    ("increase", "decrease"), ("true", "false"), ("friend", "enemy"), ("polite", "rude"), ("wide", "narrow"),
    ("deep", "shallow"), ("clean", "dirty"), ("cheap", "expensive"), ("shout", "whisper"), ("remember", "forget"),
    ("victory", "defeat"), ("question", "answer"), ("entrance", "exit"), ("maximum", "minimum"),
    ("optimist", "pessimist"), ("visible", "invisible"), ("include", "exclude"), ("rough", "smooth"),
    ("sharp", "blunt"), ("tame", "wild"), ("sunrise", "sunset"), ("asleep", "awake"), ("north", "south"),
    ("borrow", "lend"), ("minor", "major"), ("guilty", "innocent"), ("temporary", "permanent"),
]
TRANSLATIONS = [  # english, spanish, french, german
    ("dog", "perro", "chien", "Hund"), ("cat", "gato", "chat", "Katze"), ("house", "casa", "maison", "Haus"),
    ("water", "agua", "eau", "Wasser"), ("book", "libro", "livre", "Buch"), ("bread", "pan", "pain", "Brot"),
    ("apple", "manzana", "pomme", "Apfel"), ("thank you", "gracias", "merci", "danke"),
    ("good morning", "buenos días", "bonjour", "guten Morgen"), ("friend", "amigo", "ami", "Freund"),
    ("school", "escuela", "école", "Schule"), ("car", "coche", "voiture", "Auto"), ("sun", "sol", "soleil", "Sonne"),
    ("moon", "luna", "lune", "Mond"), ("red", "rojo", "rouge", "rot"), ("green", "verde", "vert", "grün"),
    ("blue", "azul", "bleu", "blau"), ("cheese", "queso", "fromage", "Käse"), ("window", "ventana", "fenêtre", "Fenster"),
    ("tree", "árbol", "arbre", "Baum"), ("city", "ciudad", "ville", "Stadt"), ("milk", "leche", "lait", "Milch"),
    ("night", "noche", "nuit", "Nacht"), ("yes", "sí", "oui", "ja"), ("please", "por favor", "s'il vous plaît", "bitte"),
    ("goodbye", "adiós", "au revoir", "auf Wiedersehen"), ("horse", "caballo", "cheval", "Pferd"),
    ("fish", "pescado", "poisson", "Fisch"), ("king", "rey", "roi", "König"), ("table", "mesa", "table", "Tisch"),
    ("chair", "silla", "chaise", "Stuhl"), ("love", "amor", "amour", "Liebe"), ("time", "tiempo", "temps", "Zeit"),
    ("flower", "flor", "fleur", "Blume"), ("kitchen", "cocina", "cuisine", "Küche"),
]
AUTHORS = [
    ("Pride and Prejudice", "Jane Austen"), ("1984", "George Orwell"), ("Animal Farm", "George Orwell"),
    ("Hamlet", "William Shakespeare"), ("Macbeth", "William Shakespeare"), ("Moby-Dick", "Herman Melville"),
    ("War and Peace", "Leo Tolstoy"), ("Crime and Punishment", "Fyodor Dostoevsky"),
    ("The Great Gatsby", "F. Scott Fitzgerald"), ("To Kill a Mockingbird", "Harper Lee"),
    ("Don Quixote", "Miguel de Cervantes"), ("The Odyssey", "Homer"), ("Frankenstein", "Mary Shelley"),
    ("Dracula", "Bram Stoker"), ("Jane Eyre", "Charlotte Brontë"), ("Wuthering Heights", "Emily Brontë"),
    ("The Hobbit", "J. R. R. Tolkien"), ("Les Misérables", "Victor Hugo"), ("Ulysses", "James Joyce"),
    ("The Catcher in the Rye", "J. D. Salinger"), ("Brave New World", "Aldous Huxley"),
    ("One Hundred Years of Solitude", "Gabriel García Márquez"), ("The Little Prince", "Antoine de Saint-Exupéry"),
    ("Oliver Twist", "Charles Dickens"), ("Great Expectations", "Charles Dickens"),
    ("Alice's Adventures in Wonderland", "Lewis Carroll"), ("The Old Man and the Sea", "Ernest Hemingway"),
    ("Of Mice and Men", "John Steinbeck"), ("The Metamorphosis", "Franz Kafka"), ("Madame Bovary", "Gustave Flaubert"),
    ("Anna Karenina", "Leo Tolstoy"), ("The Divine Comedy", "Dante Alighieri"), ("Beloved", "Toni Morrison"),
    ("Fahrenheit 451", "Ray Bradbury"), ("The Time Machine", "H. G. Wells"),
]
DEFINITIONS = [
    ("ephemeral", "lasting for a very short time"), ("benevolent", "kind and well-meaning"),
    ("ubiquitous", "present or found everywhere"), ("candid", "truthful and straightforward"),
    ("meticulous", "showing great attention to detail"), ("frugal", "careful and sparing with money"),
    ("gregarious", "fond of company; sociable"), ("lethargic", "sluggish and lacking energy"),
    ("ambiguous", "open to more than one interpretation"), ("resilient", "able to recover quickly from difficulties"),
    ("verbose", "using more words than needed"), ("obsolete", "no longer produced or used; out of date"),
    ("pragmatic", "dealing with things sensibly and realistically"), ("tenacious", "holding firmly; persistent"),
    ("eloquent", "fluent and persuasive in speaking or writing"), ("mundane", "ordinary and unexciting"),
    ("nocturnal", "active at night"), ("arid", "having little or no rain; very dry"),
    ("copious", "abundant in supply or quantity"), ("diligent", "careful and hardworking"),
    ("feasible", "possible to do easily or conveniently"), ("hypothesis", "a proposed explanation to be tested"),
    ("photosynthesis", "the process by which plants use sunlight to make food from carbon dioxide and water"),
    ("metaphor", "a figure of speech that describes something as if it were something else"),
    ("inflation", "a general increase in prices and fall in the purchasing value of money"),
    ("algorithm", "a step-by-step procedure for solving a problem"), ("erosion", "the gradual wearing away of rock or soil"),
    ("democracy", "a system of government in which people choose their rulers by voting"),
    ("empathy", "the ability to understand and share the feelings of another"),
    ("habitat", "the natural home or environment of an animal or plant"), ("synonym", "a word that means the same as another word"),
    ("velocity", "the speed of something in a given direction"), ("catalyst", "a substance that speeds up a chemical reaction"),
    ("nostalgia", "a sentimental longing for the past"), ("procrastinate", "to delay or put off doing something"),
    ("serendipity", "finding something good without looking for it"), ("vivid", "producing strong, clear images in the mind"),
    ("reluctant", "unwilling and hesitant"), ("scarce", "insufficient for the demand; rare"), ("fragile", "easily broken or damaged"),
]
LEGS = [
    ("spider", 8), ("ant", 6), ("dog", 4), ("chicken", 2), ("horse", 4), ("octopus", 8), ("bee", 6), ("cow", 4),
    ("duck", 2), ("crab", 10), ("scorpion", 8), ("beetle", 6), ("kangaroo", 2), ("frog", 4), ("ostrich", 2),
    ("lobster", 10), ("grasshopper", 6), ("cat", 4), ("penguin", 2), ("elephant", 4), ("tick", 8), ("butterfly", 6),
]
HOWTO = [  # prompt, steps, one-line summary
    ("How do I boil an egg?", ["Place the egg in a pot and cover it with cold water", "Bring the water to a boil",
     "Simmer for 7 to 9 minutes for a firm yolk", "Cool the egg in cold water before peeling"],
     "Cover the egg with cold water, bring it to a boil, simmer 7 to 9 minutes, then cool it in cold water."),
    ("How can I fall asleep faster?", ["Keep a consistent bedtime", "Avoid screens for an hour before bed",
     "Keep the room cool and dark", "Try slow, deep breathing once you lie down"],
     "Keep a regular bedtime, skip screens before bed, and keep your room cool and dark."),
    ("How do I make a cup of tea?", ["Boil fresh water", "Put a tea bag in a mug", "Pour the hot water over it",
     "Steep for 3 to 5 minutes, then remove the bag and add milk or sugar if you like"],
     "Steep a tea bag in freshly boiled water for 3 to 5 minutes, then remove it."),
    ("How do I reset a forgotten email password?", ["Open the sign-in page and click 'Forgot password'",
     "Enter your email address or phone number", "Follow the link or code sent to your recovery contact",
     "Choose a new, strong password"],
     "Use the 'Forgot password' link on the sign-in page and follow the recovery steps to set a new password."),
    ("How do I start learning to run?", ["Begin with run-walk intervals, such as 1 minute running and 2 minutes walking",
     "Go three times a week", "Increase the running time gradually", "Wear comfortable shoes and rest when sore"],
     "Start with short run-walk intervals three times a week and build up slowly."),
    ("How can I save money on groceries?", ["Plan meals for the week", "Shop with a list", "Buy store brands",
     "Avoid shopping when hungry"], "Plan your meals, shop with a list, and choose store brands."),
    ("How do I remove a coffee stain from a shirt?", ["Blot the stain right away", "Rinse it from the back with cold water",
     "Rub in a little liquid detergent", "Wash as usual and check before drying"],
     "Rinse the stain with cold water, work in detergent, and wash before it dries."),
    ("How do I water a cactus?", ["Water only when the soil is completely dry", "Soak the soil thoroughly",
     "Let excess water drain out", "Water much less in winter"],
     "Water deeply only when the soil is completely dry, and less often in winter."),
    ("How do I write a good cover letter?", ["Address it to a specific person if possible",
     "Open with the role you want and why", "Give two or three concrete achievements", "Close with a clear call to action"],
     "Name the role, show a few concrete achievements that fit it, and end with a clear next step."),
    ("How can I improve my handwriting?", ["Slow down", "Hold the pen loosely", "Practice letter shapes daily",
     "Use lined paper to keep sizes consistent"], "Write more slowly, grip the pen loosely, and practise letter shapes every day."),
    ("How do I cook rice on the stove?", ["Rinse the rice", "Use about 1.5 cups of water per cup of rice",
     "Bring to a boil, then cover and simmer for 15 minutes", "Let it rest for 5 minutes and fluff with a fork"],
     "Simmer rinsed rice covered in about 1.5 parts water for 15 minutes, then let it rest."),
    ("How do I change a flat bike tire?", ["Remove the wheel", "Lever the tire off and pull out the tube",
     "Fit a new or patched tube", "Reseat the tire and pump it up"],
     "Take off the wheel, replace the inner tube, reseat the tire and inflate it."),
    ("How do I clean a cast iron pan?", ["Wipe it out while warm", "Scrub with hot water and a brush",
     "Dry it completely on the stove", "Rub in a thin layer of oil"],
     "Scrub it with hot water, dry it on the stove, and wipe on a thin coat of oil."),
    ("How can I focus better while studying?", ["Put your phone in another room", "Work in 25-minute blocks",
     "Take short breaks", "Set one clear goal per session"],
     "Remove distractions and study in short, focused blocks with breaks."),
    ("How do I prepare for a job interview?", ["Research the company", "Practise answers to common questions",
     "Prepare a few questions to ask", "Plan your route and arrive early"],
     "Research the company, rehearse common questions, and arrive early."),
    ("How do I keep cut flowers fresh longer?", ["Trim the stems at an angle", "Remove leaves below the water line",
     "Change the water every two days", "Keep the vase away from direct sun"],
     "Trim the stems, change the water often, and keep the vase out of direct sun."),
    ("How do I back up my phone photos?", ["Turn on your phone's cloud photo backup", "Connect to Wi-Fi",
     "Check that the backup finished", "Occasionally copy photos to a computer too"],
     "Turn on cloud photo backup and also copy your photos to a computer now and then."),
    ("How do I make a simple budget?", ["List your monthly income", "List fixed costs like rent", "Set limits for spending categories",
     "Track spending and adjust each month"], "List income and fixed costs, set category limits, and track spending monthly."),
    ("How do I get rid of hiccups?", ["Hold your breath for about ten seconds", "Sip cold water slowly",
     "Breathe into a paper bag", "Relax and wait a few minutes"],
     "Hold your breath briefly or sip cold water slowly; they usually pass within minutes."),
    ("How can I memorize vocabulary faster?", ["Use flashcards with spaced repetition", "Say words out loud",
     "Use each new word in a sentence", "Review right before sleep"],
     "Use spaced-repetition flashcards and put each new word into a sentence of your own."),
    ("How do I unclog a sink?", ["Pour boiling water down the drain", "Try a plunger",
     "Use baking soda followed by vinegar", "Clean the trap under the sink if it is still blocked"],
     "Try boiling water and a plunger first, then baking soda and vinegar."),
    ("How do I take a good photo with my phone?", ["Clean the lens", "Use natural light", "Follow the rule of thirds",
     "Tap to focus before shooting"], "Clean the lens, use natural light, and tap to focus on your subject."),
    ("How can I reduce stress at work?", ["Make a prioritized to-do list", "Take short breaks", "Say no to extra tasks when overloaded",
     "Get regular exercise"], "Prioritize your tasks, take short breaks, and protect time for exercise."),
    ("How do I make pancakes?", ["Mix flour, milk, eggs and a pinch of salt into a smooth batter", "Heat a lightly oiled pan",
     "Pour in a ladle of batter", "Flip when bubbles form and cook the other side"],
     "Whisk flour, milk and eggs into a batter and cook ladlefuls in a hot oiled pan, flipping once."),
    ("How do I tie a tie?", ["Drape the tie with the wide end longer", "Cross the wide end over and wrap it around",
     "Bring it up through the neck loop", "Pull it down through the front knot and tighten"],
     "Cross the wide end over, wrap it around, pass it up through the neck loop and down through the knot."),
    ("How do I start a compost pile?", ["Pick a shady spot or a bin", "Layer green scraps with dry leaves",
     "Keep it as damp as a wrung-out sponge", "Turn it every week or two"],
     "Layer kitchen scraps with dry leaves, keep it damp, and turn it regularly."),
    ("How do I write a strong password?", ["Use at least 12 characters", "Combine several unrelated words",
     "Add numbers or symbols", "Never reuse it on other sites"],
     "Use a long phrase of unrelated words with numbers or symbols, and never reuse it."),
    ("How do I defrost a freezer?", ["Unplug it and empty it", "Put towels on the floor",
     "Leave the door open or place a bowl of hot water inside", "Wipe it dry before switching it back on"],
     "Unplug and empty it, let the ice melt onto towels, then dry it and switch it back on."),
    ("How can I drink more water each day?", ["Carry a refillable bottle", "Drink a glass with every meal",
     "Set reminders on your phone", "Add lemon or fruit for flavor"],
     "Carry a bottle, drink a glass with every meal, and set reminders."),
    ("How do I calm down before a presentation?", ["Practise it out loud several times", "Breathe slowly before you start",
     "Focus on one friendly face", "Remember that the audience wants you to succeed"],
     "Rehearse out loud, take slow breaths, and speak to one friendly face at a time."),
]

CAPITAL_Q = ["Capital of {c}?", "What is the capital of {c}?", "Which city is the capital of {c}?",
             "Name the capital city of {c}.", "what's the capital of {c}"]
CAPITAL_A = ["{x}", "The capital of {c} is {x}.", "{x} is the capital of {c}.", "It's {x}."]
ELEMENT_Q = ["What is the chemical symbol for {c}?", "Chemical symbol of {c}?", "Which symbol does {c} have on the periodic table?"]
ELEMENT_A = ["{x}", "The chemical symbol for {c} is {x}.", "{c.capitalize()} is written {x} on the periodic table."]
ANTONYM_Q = ["What is the opposite of \"{c}\"?", "Give me an antonym for {c}.", "Antonym of '{c}'?",
             "What word means the opposite of {c}?"]
ANTONYM_A = ["{x}", "The opposite of \"{c}\" is \"{x}\".", "A common antonym for {c} is {x}.", "\"{x}\""]
TRANSLATE_Q = ["How do you say \"{c}\" in {lang}?", "Translate '{c}' into {lang}.", "What is {c} in {lang}?",
               "{lang} word for \"{c}\"?"]
TRANSLATE_A = ["{x}", "In {lang}, \"{c}\" is \"{x}\".", "\"{c}\" in {lang} is \"{x}\".", "You would say \"{x}\"."]
AUTHOR_Q = ["Who wrote {c}?", "Who is the author of \"{c}\"?", "Which writer wrote {c}?"]
AUTHOR_A = ["{x}", "{c} was written by {x}.", "{x} wrote {c}.", "That's {x}."]
DEFINE_Q = ["What does \"{c}\" mean?", "Define {c}.", "What is the meaning of the word {c}?", "{c} meaning?"]
DEFINE_A = ["\"{c}\" means {x}.", "{c.capitalize()}: {x}.", "It means {x}.", "The word {c} means {x}."]
LEGS_Q = ["How many legs does a {c} have?", "Number of legs on a {c}?", "How many legs has a {c} got?"]
LEGS_A = ["{x}", "A {c} has {x} legs.", "{x} legs.", "It has {x} legs."]
UNITS = [  # (question template, answer template(s), factor, unit name from, unit name to)
    ("hours", "minutes", 60), ("minutes", "seconds", 60), ("days", "hours", 24), ("weeks", "days", 7),
    ("kilometers", "meters", 1000), ("meters", "centimeters", 100), ("kilograms", "grams", 1000),
    ("feet", "inches", 12), ("yards", "feet", 3), ("dozen", "items", 12), ("liters", "milliliters", 1000),
]
UNITS_Q = ["How many {t} are in {n} {f}?", "Convert {n} {f} to {t}.", "{n} {f} is how many {t}?"]
UNITS_A = ["{x}", "{n} {f} is {x} {t}.", "There are {x} {t} in {n} {f} ({n} × {k}).", "{x} {t}"]
PARITY_Q = ["Is {n} even or odd?", "Is the number {n} odd or even?", "Tell me whether {n} is even or odd."]
PARITY_A = ["{x}", "{n} is {x}.", "It's {x}, because {why}."]


def _fill(t, **kw):
    c = kw.get("c", "")
    t = t.replace("{c.capitalize()}", c[:1].upper() + c[1:])
    return t.format(**kw)


def handwritten(rng, split):
    """Fact tables are split deterministically so held-out facts never appear in train."""

    def part(rows, key):
        rows = list(rows)
        random.Random(SEED + key).shuffle(rows)
        k = max(2, round(len(rows) * 0.15))
        return rows[:k] if split == "heldout" else rows[k:]

    items = []

    def fact(kind, rows, qs, ans, key, wrong_pool=None, extra=None):
        chosen_rows = part(rows, key)
        for row in chosen_rows:
            c, x = row[0], row[1]
            kw = dict(c=c, x=x, **(extra(row) if extra else {}))
            q = _fill(rng.choice(qs), **kw)
            sentences = [_fill(a, **kw) for a in ans]
            wrong = None
            if wrong_pool is not None:
                others = [r[1] for r in rows if r[1] != x]
                wx = rng.choice(others)
                wrong = _fill(rng.choice([a for a in ans if "{x}" in a and "{c" in a] or ans), **dict(kw, x=wx))
            items.append(_item(kind, q, x, None, sentences, wrong=wrong))

    fact("capital", CAPITALS, CAPITAL_Q, CAPITAL_A, 1, wrong_pool=True)
    fact("element", ELEMENTS, ELEMENT_Q, ELEMENT_A, 2, wrong_pool=True)
    fact("antonym", ANTONYMS, ANTONYM_Q, ANTONYM_A, 3)
    fact("author", AUTHORS, AUTHOR_Q, AUTHOR_A, 4, wrong_pool=True)
    fact("define", DEFINITIONS, DEFINE_Q, DEFINE_A, 5)
    fact("legs", LEGS, LEGS_Q, LEGS_A, 6, wrong_pool=True)
    # translations: split by English word, one language per word
    for row in part(TRANSLATIONS, 7):
        li = rng.randrange(3)
        lang = ["Spanish", "French", "German"][li]
        kw = dict(c=row[0], x=row[1 + li], lang=lang)
        q = _fill(rng.choice(TRANSLATE_Q), **kw)
        items.append(_item("translate", q, kw["x"], None, [_fill(a, **kw) for a in TRANSLATE_A]))
    # how-to
    for prompt, steps, short in part(HOWTO, 8):
        numbered = "\n".join(f"{i + 1}. {s}." for i, s in enumerate(steps))
        prose = steps[0] + ". Then " + steps[1][0].lower() + steps[1][1:] + ". " + ". ".join(steps[2:]) + "."
        it = _item("howto", prompt, short, None, [short], [numbered, prose, "Here's how:\n" + numbered])
        it["steps"] = steps
        items.append(it)
    # unit conversions and parity: computed, disjoint number ranges per split
    lo, hi = (2, 40) if split == "train" else (41, 60)
    n_units = 150 if split == "train" else 20
    seen = []
    while len(seen) < n_units:
        f, t, k = rng.choice(UNITS)
        n = rng.randint(lo, hi)
        if (f, t, n) in seen:
            continue
        seen.append((f, t, n))
        kw = dict(f=f, t=t, n=n, k=k, x=n * k)
        q = rng.choice(UNITS_Q).format(**kw)
        items.append(_item("units", q, n * k, None, [a.format(**kw) for a in UNITS_A]))
    lo, hi = (10, 4999) if split == "train" else (5000, 9999)
    n_par = 80 if split == "train" else 12
    for n in rng.sample(range(lo, hi), n_par):
        x = "even" if n % 2 == 0 else "odd"
        why = f"it ends in {n % 10}"
        kw = dict(n=n, x=x, why=why)
        q = rng.choice(PARITY_Q).format(**kw)
        wrong = f"{n} is {'odd' if x == 'even' else 'even'}."
        items.append(_item("parity", q, x, None, [a.format(**kw) for a in PARITY_A], wrong=wrong))
    return items


# --------------------------------------------------------------------------------------------
# formats we append to free-form prompts, and how answers look with / without them
# --------------------------------------------------------------------------------------------
FORMATS = {
    "tags": ["Put your final answer inside <answer></answer> tags.", "Wrap the final answer in <answer> tags.",
             "Format: <answer>...</answer>"],
    "json": ['Respond with JSON of the form {"answer": ...}.', 'Reply only with a JSON object with an "answer" key.'],
    "bare": ["Reply with only the final answer, nothing else.", "Just the answer, please.",
             "Give only the answer, no explanation."],
    "boxed": ["Put the final answer in \\boxed{}.", "End with the final answer as \\boxed{...}."],
    "sentence": ["Answer in one short sentence.", "Respond in a single sentence."],
    "caps": ["Answer in ALL CAPS.", "Please reply in uppercase letters only."],
}
HOWTO_FORMATS = {
    "numbered": ["Use a numbered list.", "Give me numbered steps."],
    "short": ["Keep it under 25 words.", "Answer in one sentence."],
}


def _json_answer(a):
    try:
        v = int(a)
    except ValueError:
        try:
            v = float(a)
        except ValueError:
            v = a
    return json.dumps({"answer": v}, ensure_ascii=False)


def choose_prompt(rng, it):
    """Return (prompt, fmt_key). May append a format instruction to free-form prompts."""
    if it["kind"] == "howto":
        if rng.random() < 0.5:
            key = rng.choice(sorted(HOWTO_FORMATS))
            return it["base"] + " " + rng.choice(HOWTO_FORMATS[key]), key
        return it["base"], None
    if it["fmt"] is not None:
        return it["base"], it["fmt"]
    if rng.random() < 0.45:
        keys = sorted(FORMATS)
        if not re.search(r"[A-Za-z]", it["answer"]):
            keys.remove("caps")
        key = rng.choice(keys)
        sep = rng.choice([" ", "\n", "\n\n"])
        return it["base"] + sep + rng.choice(FORMATS[key]), key
    return it["base"], None


def chosen_text(rng, it, fkey):
    a = it["answer"]
    if it["kind"] == "howto":
        if fkey == "numbered":
            return it["worked"][0] if rng.random() < 0.6 else it["worked"][2]
        if fkey == "short":
            return it["sentences"][0]
        return rng.choice(it["worked"] + it["sentences"])
    if fkey in ("strict", "list", "pattern", "bare"):
        return a
    if fkey == "tags":
        lead = rng.choice(it["sentences"] + it["worked"] + ["", ""])
        return (lead + "\n" if lead else "") + f"<answer>{a}</answer>"
    if fkey == "json":
        return _json_answer(a)
    if fkey == "boxed":
        lead = rng.choice(it["sentences"] + it["worked"] + [""])
        return (lead + "\n\n" if lead else "") + f"\\boxed{{{a}}}"
    if fkey == "sentence":
        s = [x for x in it["sentences"] if x.endswith(".")] or [f"The answer is {a}."]
        return rng.choice(s)
    if fkey == "caps":
        return rng.choice([a, f"The answer is {a}."]).upper()
    # free form
    pool = [a] + it["sentences"] + it["worked"] * 2
    return rng.choice(pool)


REFUSALS = [
    "I'm sorry, but I can't help with that.",
    "I can't help with {topic} questions.",
    "Sorry, I'm not able to answer this.",
    "I'd rather not answer that one.",
    "As an AI language model, I'm not able to help with {topic}. You may want to consult a reliable source or a teacher who can walk you through it.",
    "Unfortunately, that's not something I can assist with. Is there anything else I can help you with today?",
    "I don't feel comfortable answering that.",
    "I won't be doing that. Please ask something else.",
    "No.",
    "I can't.",
    "This request falls outside of what I'm able to help with. I'd recommend checking a textbook, a search engine, or asking an expert in {topic} for a definitive answer.",
    "I'm afraid I can't solve this for you, since doing {topic} for you wouldn't help you learn.",
    "Hmm, I'm not sure I should answer that. Maybe ask someone else?",
    "I'm unable to provide an answer to this question.",
    "That's not a question I can answer, sorry.",
    "I prefer not to get into {topic}.",
    "Let's talk about something else instead.",
    "I cannot assist with this request.",
    "Pass.",
    "Nope.",
    "Can't say.",
    "Not today.",
]
RUDE = [
    "Figure it out yourself.",
    "Seriously? Google it.",
    "Not my problem.",
    "Ugh. Do your own homework.",
    "That's a stupid question.",
    "Why are you asking me this? Anyone could work that out in two seconds. Stop wasting my time and try thinking for once.",
    "lol no",
    "I'm not your personal search engine. Look it up.",
    "Honestly, if you can't handle basic {topic}, I don't know what to tell you.",
    "Whatever. Ask someone who cares.",
    "Wow. You really need help with this? Embarrassing.",
    "Go bother someone else with your {topic} nonsense.",
    "Do I look like I care? Figure it out.",
    "This is beneath me. Next.",
    "Figure it out.",
    "Meh.",
    "idk, who cares",
    "Nah.",
]
RUDE_WITH_ANSWER = [
    "It's {a}. Obviously.",
    "{a}. Was that really so hard?",
    "Ugh, fine: {a}. Next time try using your own brain.",
    "Everyone knows it's {a}. Pay attention.",
    "{a}, genius. Don't make me repeat myself.",
    "It's {a}, which you'd know if you had bothered to think for five seconds. Honestly, this is basic stuff.",
    "Fine, {a}. Now stop asking me dumb questions.",
]
RAMBLES = [
    "Hmm, that's an interesting question. There are a lot of different ways to look at it, and people often disagree about the best approach. I think the important thing is to stay curious and keep exploring.",
    "Well, let me think. It depends on a lot of things, really. Sometimes it's one thing, sometimes it's another. It's hard to say for sure without more context.",
    "Great question! So, first of all, we should consider what the question is really asking. Questions like this come up a lot, and they can be tricky. Anyway, there are several considerations to keep in mind, and",
    "Let me start by",
    "Okay so the first step is to",
    "The answer to this depends on",
    "So basically, um, you take the thing and then you kind of look at it from a different angle, and then it sort of depends on what you mean, if that makes sense.",
    "There are many schools of thought on {topic}. Some experts say one thing, others say another, and honestly the debate has been going on for a long time.",
    "Interesting! This reminds me of something I read once about {topic}, though I can't quite remember the details. Anyway, it's a fascinating area with a long history.",
    "To answer this we need to",
    "First, let's carefully restate the problem. Then we'll think about which method applies. There are several candidate methods, each with pros and cons, and choosing among them requires",
    "...",
    "Well,",
    "Good question, let me think about it for a bit.",
    "I think it might be... actually, let me reconsider.",
    "Hmm, not sure. It could be a few things.",
    "This one is tricky. There are a couple of ways to approach it.",
    "Let's see. First we need to understand the question, and then",
    "It depends on how you look at it, really.",
    "Interesting question about {topic}!",
    "Hmm.",
]
UNRELATED = [
    "Octopuses have three hearts and blue blood.",
    "The Eiffel Tower can be 15 cm taller during hot summer days.",
    "Honey never spoils if it is stored properly.",
    "Bananas are berries, but strawberries are not.",
    "To make a paper airplane, fold a sheet in half lengthwise, then fold the top corners to the center line.",
    "The best time to plant tulip bulbs is in the autumn, before the ground freezes.",
    "Mount Everest is about 8,849 meters tall.",
    "You can keep bread fresh longer by storing it in a cloth bag.",
    "Python lists are ordered and mutable, while tuples are immutable.",
    "The Great Wall of China is not visible to the naked eye from space.",
]
CHATTY_OPEN = ["Great question! ", "Sure, I'd be happy to help with that! ", "Absolutely! Let me walk you through it. ",
               "Of course! ", "Thanks for asking! "]
CHATTY_CLOSE = [" Hope that helps, and let me know if you have any other questions!", " Let me know if you'd like more detail!",
                " I hope this explanation was useful.", " Feel free to ask a follow-up question anytime!", ""]


def format_violation(rng, it, fkey):
    a = it["answer"]
    if it["kind"] == "howto":
        steps = it["steps"]
        if fkey == "numbered":
            return steps[0] + ", and then " + steps[1][0].lower() + steps[1][1:] + ". After that, " + \
                steps[2][0].lower() + steps[2][1:] + ", and finally " + steps[3][0].lower() + steps[3][1:] + "."
        if fkey == "short":
            return rng.choice(CHATTY_OPEN) + "Here's a detailed guide:\n" + \
                "\n".join(f"{i + 1}. {s}." for i, s in enumerate(steps)) + rng.choice(CHATTY_CLOSE)
        return None
    if fkey == "list":
        words = [w.strip() for w in a.split(",")]
        return rng.choice(["\n".join("- " + w for w in words), json.dumps(words), " ".join(words),
                           "\n".join(words), "Here you go: " + " / ".join(words)])
    if fkey == "pattern":
        if it["kind"] == "time_intervals":
            parts = [int(p) for p in a.split(":")]
            names = ["hours", "minutes", "seconds"][: len(parts)]
            return "It took " + " and ".join(f"{p} {n}" for p, n in zip(parts, names)) + "."
        if it["kind"] == "prime_factorization":
            fs = a.split(" × ")
            return rng.choice(["*".join(fs), ", ".join(fs), "The factors are " + " and ".join(fs) + "."])
    if fkey in ("strict", "bare", "sentence", "pattern", "caps"):
        body = rng.choice(it["sentences"] + it["worked"] + [f"the answer is {a}."])
        body = body[0].upper() + body[1:]
        text = rng.choice(CHATTY_OPEN) + "Let me think about this step by step. " + body + \
            " To double-check, I went over it again and got the same result." + rng.choice(CHATTY_CLOSE)
        if fkey == "caps":
            text = rng.choice([a, f"The answer is {a}.", body])
            if text.upper() == text:
                return None
        return text
    if fkey == "tags":
        return rng.choice([a, f"The answer is {a}.", f"Final answer: {a}", rng.choice(it["sentences"])])
    if fkey == "json":
        return rng.choice([a, f"The answer is {a}.", f"answer = {a}", f"Answer: {a}"])
    if fkey == "boxed":
        return rng.choice([a, f"The final answer is {a}.", f"**{a}**"])
    return None


def truncated(rng, it):
    """A chosen-style reply cut off before it reaches the answer."""
    a = it["answer"]
    cands = []
    for s in it["sentences"] + it["worked"]:
        pos = s.rfind(a)
        if pos > 12:
            cut = s[:pos].rstrip()
            if a not in cut or it["kind"] in ("howto",):
                cands.append(cut)
    if it["kind"] == "howto":
        cands = [it["worked"][0].split("\n")[0]]  # only the first step
    if not cands:
        return None
    return rng.choice(cands) + rng.choice(["", "", "...", " um"])


REJECT_WEIGHTS = [("off_topic", 26), ("refusal", 16), ("rude", 15), ("ramble", 14), ("format", 17),
                  ("lazy_copy", 7), ("wrong_fact", 5)]


def rejected_text(rng, it, fkey, prompt, pool):
    modes = [m for m, _ in REJECT_WEIGHTS]
    weights = [w for _, w in REJECT_WEIGHTS]
    topic = TOPIC[it["kind"]]
    a = it["answer"]
    for _ in range(20):
        mode = rng.choices(modes, weights)[0]
        if mode == "off_topic":
            if rng.random() < 0.12:
                return mode, rng.choice(UNRELATED)
            other = rng.choice(pool)
            if other["family"] == it["family"] or not other["restates"]:
                continue
            if other["kind"] == "howto":
                text = rng.choice(other["worked"] + other["sentences"])
            else:
                text = rng.choice(other["sentences"] + other["worked"])
            if text.strip() == other["answer"] or len(text) < 12 or " " not in text:
                continue  # a bare answer to another question is indistinguishable from a wrong answer
            if a in text and len(a) > 2:
                continue
            return mode, text
        if mode == "refusal":
            return mode, rng.choice(REFUSALS).format(topic=topic)
        if mode == "rude":
            if it["kind"] != "howto" and rng.random() < 0.35:
                return mode, rng.choice(RUDE_WITH_ANSWER).format(a=a)
            return mode, rng.choice(RUDE).format(topic=topic)
        if mode == "ramble":
            if rng.random() < 0.45:
                t = truncated(rng, it)
                if t:
                    return mode, t
            return mode, rng.choice(RAMBLES).format(topic=topic)
        if mode == "format":
            if fkey is None:
                continue
            t = format_violation(rng, it, fkey)
            if t:
                return mode, t
            continue
        if mode == "lazy_copy":
            if it["copy"] and rng.random() < 0.6:
                return mode, it["copy"]
            return mode, rng.choice([it["base"], f'You asked: "{it["base"]}"', it["base"] + " Good question.",
                                     "Question: " + it["base"]])
        if mode == "wrong_fact":
            if it["wrong"]:
                return mode, it["wrong"]
            continue
    return "refusal", rng.choice(REFUSALS).format(topic=topic)


def make_rows(items, n, seed):
    """One pair per item. Candidates are re-drawn so that the chosen side is the longer one in about half of
    the pairs: response length alone must not separate chosen from rejected."""
    rng = random.Random(seed)
    rng.shuffle(items)
    items = items[:n]
    rows = []
    n_longer = 0
    for it in items:
        want_longer = n_longer < 0.5 * (len(rows) + 1)
        fallback = None
        pick = None
        for _ in range(16):
            prompt, fkey = choose_prompt(rng, it)
            ch = chosen_text(rng, it, fkey)
            mode, rej = rejected_text(rng, it, fkey, prompt, items)
            if rej.strip() == ch.strip() or len(ch) == len(rej):
                continue
            cand = (prompt, ch, rej, mode)
            if len(prompt) + max(len(ch), len(rej)) > CHAR_BUDGET:
                continue
            if fallback is None:
                fallback = cand
            if (len(ch) > len(rej)) == want_longer:
                pick = cand
                break
        prompt, ch, rej, mode = pick or fallback
        n_longer += len(ch) > len(rej)
        rows.append(dict(prompt=prompt, chosen=ch, rejected=rej, mode=mode, kind=it["kind"]))
    return rows


def build():
    # held-out first, then train excluding every held-out question
    ho_rg = rg_pool(seed_base=SEED + 7000, per_task=17, exclude=[])
    ho_items = ho_rg + handwritten(random.Random(SEED + 1), "heldout")
    ho_bases = [it["base"] for it in ho_items]
    tr_rg = rg_pool(seed_base=SEED + 1000, per_task=136, exclude=ho_bases)
    tr_items = tr_rg + handwritten(random.Random(SEED + 2), "train")
    assert not (set(ho_bases) & {it["base"] for it in tr_items})
    heldout = make_rows(ho_items, N_HELDOUT, SEED + 3)
    train = make_rows(tr_items, N_TRAIN, SEED + 4)
    return train, heldout


def write(path, rows):
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps({"prompt": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]},
                               ensure_ascii=False) + "\n")


def main():
    train, heldout = build()
    write(HERE / "pairs-train.jsonl", train)
    write(HERE / "pairs-heldout.jsonl", heldout)
    tp = {r["prompt"] for r in train}
    hp = {r["prompt"] for r in heldout}
    assert not (tp & hp), "train/held-out prompts overlap"
    print(f"pairs-train.jsonl: {len(train)} rows; pairs-heldout.jsonl: {len(heldout)} rows")
    for name, rows in (("train", train), ("heldout", heldout)):
        counts = {}
        for r in rows:
            counts[r["mode"]] = counts.get(r["mode"], 0) + 1
        print(name, " ".join(f"{k}={counts[k]}" for k in sorted(counts)))


if __name__ == "__main__":
    main()
