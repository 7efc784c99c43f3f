"""The demo model's chat format and the synthetic chat data it is fine-tuned on
(scripts/train_demo_model.py --chat) and evaluated on (scripts/eval_demo_chat.py).

CHAT_TEMPLATE has Qwen3's shape over the demo's byte-level tokenizer, whose one special token is
`<|endoftext|>` (id 0, the EOS): `<|im_start|>ROLE\\n ... ` turns; an optional system message and
the `tools` (one JSON object a line inside `<tools></tools>`) in the first, system turn; an
assistant's calls as hermes blocks, `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`
(arguments given as a JSON string are written as they are, an object is written with tojson); tool
results as `<tool_response>` blocks inside one user turn; the reasoning of the assistant turns after
the last user query in `<think>\\n...\\n</think>\\n\\n` (from `reasoning_content`, or split off the
content at `</think>`); `add_generation_prompt` opens an assistant turn, and `enable_thinking=false`
opens an empty `<think>\\n\\n</think>\\n\\n` block in it (thinking is on by default, as in Qwen3).
Every turn ends with `<|endoftext|>` where Qwen3 writes `<|im_end|>`: here `<|im_end|>` would be
ordinary text (several byte-level tokens) that the model would write before the EOS and a client
would see in the answer, so the turn end is the EOS itself, as `<|im_end|>` is one of Qwen3's EOS
ids. A greedy answer thus ends where the model writes id 0, and the engine stops there.

The generator (`conversations(seed, count, split)`) draws seeded conversations in the
OpenAI message format with, per assistant turn, the text the model is to write (`targets`):
- chat: greetings, who-are-you (named by the system prompt when it names one), capitals, sums of
  small numbers, antonyms, "repeat after me", counting, Python how-tos, short functions written in a
  code block, remembering the user's name over turns, follow-up questions; system prompts or none;
- tool use: one or two tools (TOOLS: weather, arithmetic, search, files, time, currency, email,
  ... with JSON-schema parameters) in the system turn, a user asking for what one of them does, a
  `<tool_call>` whose arguments come from the request's text, the tool's result, a short answer
  that uses it; or a question no tool is for, answered directly.
Every assistant turn is drawn with thinking on (a one-line `<think>` first) or off. A
conversation's split ('train' or 'test', one in 16 held out) is fixed by blake2b of its first user
message, so no request of the held-out set ever opens a conversation trained on.
"""
from __future__ import annotations

import ast
import hashlib
import json
import random
from dataclasses import dataclass, field
from typing import Callable

CHAT_TEMPLATE = """\
{#- agent-infer demo model (scripts/demo_chat.py): Qwen3's chat shape; every turn ends with <|endoftext|>, the EOS -#}
{%- set eot = '<|endoftext|>' %}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if has_system %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- '# Tools\\n\\nYou can call the functions below to help with the request. ' }}
    {{- 'Their signatures, one a line:\\n<tools>' }}
    {%- for tool in tools %}
        {{- '\\n' + (tool | tojson) }}
    {%- endfor %}
    {{- '\\n</tools>\\n\\nTo call one, write its name and arguments as a JSON object ' }}
    {{- 'inside <tool_call></tool_call> tags:\\n' }}
    {{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call>' + eot + '\\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\\n' + messages[0].content + eot + '\\n' }}
{%- endif %}
{%- set ns = namespace(last_query=-1) %}
{%- for m in messages %}
    {%- if m.role == 'user' %}
        {%- set ns.last_query = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in messages %}
    {%- set content = m.content if m.content is string else '' %}
    {%- if m.role == 'user' or (m.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + m.role + '\\n' + content + eot + '\\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = '' %}
        {%- if m.reasoning_content is string %}
            {%- set reasoning = m.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1] %}
        {%- endif %}
        {%- set reasoning = reasoning.strip('\\n') %}
        {%- set content = content.lstrip('\\n') %}
        {{- '<|im_start|>assistant\\n' }}
        {%- if loop.index0 > ns.last_query and (loop.last or reasoning) %}
            {{- '<think>\\n' + reasoning + '\\n</think>\\n\\n' }}
        {%- endif %}
        {{- content }}
        {%- if m.tool_calls %}
            {%- for call in m.tool_calls %}
                {%- set fn = call.function if call.function is defined else call %}
                {%- if content or not loop.first %}
                    {{- '\\n' }}
                {%- endif %}
                {{- '<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
                {%- if fn.arguments is string %}
                    {{- fn.arguments }}
                {%- else %}
                    {{- fn.arguments | tojson }}
                {%- endif %}
                {{- '}\\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- eot + '\\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' + content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- eot + '\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

HELD_OUT_BUCKETS = 16  # one conversation in 16 is held out ('test')
TRAIN_SEED, EVAL_SEED = 0, 1_000_003  # the generator seeds of the fine-tune and of the evaluation


# ---------------------------------------------------------------- value pools

CITIES = ["Paris", "London", "Berlin", "Tokyo", "Madrid", "Rome", "Lisbon", "Oslo", "Cairo", "Lima", "Sydney",
          "Toronto", "Chicago", "Boston", "Seattle", "Mumbai", "Delhi", "Seoul", "Beijing", "Shanghai", "Vienna",
          "Prague", "Warsaw", "Dublin", "Athens", "Istanbul", "Nairobi", "Lagos", "Bangkok", "Hanoi", "Manila",
          "Jakarta", "Mexico City", "New York", "San Francisco", "Los Angeles", "Buenos Aires", "Santiago", "Bogota",
          "Geneva", "Amsterdam", "Brussels", "Copenhagen", "Stockholm", "Helsinki", "Reykjavik", "Auckland",
          "Cape Town", "São Paulo", "Zürich", "Montreal", "Denver", "Austin", "Miami", "Munich", "Hamburg", "Milan",
          "Naples", "Porto", "Valencia", "Kyoto", "Osaka", "Singapore", "Dubai", "Doha", "Tehran", "Karachi"]
CAPITALS = {"France": "Paris", "Germany": "Berlin", "Japan": "Tokyo", "Spain": "Madrid", "Italy": "Rome",
            "Portugal": "Lisbon", "Norway": "Oslo", "Egypt": "Cairo", "Peru": "Lima", "Canada": "Ottawa",
            "Australia": "Canberra", "India": "New Delhi", "China": "Beijing", "Russia": "Moscow",
            "Austria": "Vienna", "Poland": "Warsaw", "Ireland": "Dublin", "Greece": "Athens", "Turkey": "Ankara",
            "Kenya": "Nairobi", "Nigeria": "Abuja", "Thailand": "Bangkok", "Vietnam": "Hanoi",
            "the Philippines": "Manila", "Indonesia": "Jakarta", "Mexico": "Mexico City", "Argentina": "Buenos Aires",
            "Chile": "Santiago", "Colombia": "Bogota", "Switzerland": "Bern", "the Netherlands": "Amsterdam",
            "Belgium": "Brussels", "Denmark": "Copenhagen", "Sweden": "Stockholm", "Finland": "Helsinki",
            "Iceland": "Reykjavik", "New Zealand": "Wellington", "Brazil": "Brasilia", "Cuba": "Havana",
            "Hungary": "Budapest", "the United Kingdom": "London", "the United States": "Washington",
            "South Korea": "Seoul", "Morocco": "Rabat", "Ghana": "Accra", "Ukraine": "Kyiv", "Romania": "Bucharest",
            "Czechia": "Prague", "Scotland": "Edinburgh", "Wales": "Cardiff"}
ANTONYMS = {"hot": "cold", "big": "small", "fast": "slow", "up": "down", "light": "dark", "happy": "sad",
            "open": "closed", "old": "new", "early": "late", "full": "empty", "hard": "soft", "high": "low",
            "long": "short", "rich": "poor", "strong": "weak", "wet": "dry", "loud": "quiet", "true": "false",
            "left": "right", "good": "bad", "heavy": "light", "inside": "outside", "first": "last",
            "win": "lose", "push": "pull", "buy": "sell", "near": "far", "clean": "dirty", "thick": "thin",
            "begin": "end", "day": "night", "yes": "no", "north": "south", "east": "west", "love": "hate"}
WORDS = ["apple", "river", "stone", "cloud", "tiger", "garden", "window", "silver", "rocket", "pencil", "forest",
         "planet", "candle", "bridge", "castle", "dragon", "ocean", "violet", "winter", "summer", "coffee", "paper",
         "mirror", "harbor", "meadow", "signal", "tunnel", "marble", "pepper", "falcon", "lantern", "engine",
         "parser", "buffer", "token", "vector", "matrix", "kernel", "socket", "thread", "branch", "commit",
         "widget", "report", "budget", "ticket", "invoice", "profile", "config", "server", "client", "cache"]
SYLLABLES = ["ka", "lo", "mi", "ra", "ven", "tor", "bel", "sa", "dri", "no", "zan", "qua", "mor", "fi", "lu",
             "pe", "tha", "gor", "vi", "el", "an", "do", "ri", "sh", "ul", "ben", "cas", "tel", "mar", "ion"]
NAMES = ["Ada", "Alan", "Grace", "Linus", "Guido", "Barbara", "Ken", "Dennis", "Margaret", "Tim", "Anita",
         "Donald", "Frances", "John", "Radia", "Edsger", "Niklaus", "Bjarne", "Yukihiro", "Sophie", "Karen",
         "Hedy", "Katherine", "Maria", "Omar", "Priya", "Wei", "Lena", "Mateo", "Chloe", "Noah", "Amara", "Ivan",
         "Sara", "Kofi", "Aiko", "Ravi", "Elena", "Tom", "Zoe"]
BOT_NAMES = ["Pico", "Nova", "Bolt", "Echo", "Pixel", "Sparky", "Atlas", "Juniper", "Orbit", "Quill"]
LANGUAGES = ["Spanish", "French", "German", "Italian", "Portuguese", "Dutch", "Japanese", "Swedish"]
PHRASES = {"good morning": ["buenos días", "bonjour", "guten Morgen", "buongiorno", "bom dia", "goedemorgen",
                            "ohayō", "god morgon"],
           "thank you": ["gracias", "merci", "danke", "grazie", "obrigado", "dank je", "arigatō", "tack"],
           "good night": ["buenas noches", "bonne nuit", "gute Nacht", "buona notte", "boa noite", "goedenacht",
                          "oyasumi", "god natt"],
           "hello": ["hola", "bonjour", "hallo", "ciao", "olá", "hallo", "konnichiwa", "hej"],
           "goodbye": ["adiós", "au revoir", "auf Wiedersehen", "arrivederci", "adeus", "tot ziens", "sayōnara",
                       "hej då"],
           "cheese": ["queso", "fromage", "Käse", "formaggio", "queijo", "kaas", "chīzu", "ost"],
           "water": ["agua", "eau", "Wasser", "acqua", "água", "water", "mizu", "vatten"]}
CURRENCIES = {"USD": 1.0, "EUR": 0.92, "GBP": 0.79, "JPY": 151.0, "CHF": 0.9, "CAD": 1.36, "AUD": 1.52,
              "INR": 83.0, "CNY": 7.2, "SEK": 10.5}
TIMEZONES = {"Tokyo": "Asia/Tokyo", "Paris": "Europe/Paris", "London": "Europe/London", "New York": "America/New_York",
             "Sydney": "Australia/Sydney", "Berlin": "Europe/Berlin", "Chicago": "America/Chicago",
             "Mumbai": "Asia/Kolkata", "Dubai": "Asia/Dubai", "Singapore": "Asia/Singapore",
             "Los Angeles": "America/Los_Angeles", "Cairo": "Africa/Cairo", "São Paulo": "America/Sao_Paulo",
             "Seoul": "Asia/Seoul", "Madrid": "Europe/Madrid", "Toronto": "America/Toronto"}
SYMBOLS = ["AAPL", "MSFT", "GOOG", "AMZN", "NVDA", "TSLA", "META", "IBM", "INTC", "ORCL", "SAP", "ASML", "AMD"]
ROOMS = ["kitchen", "living room", "bedroom", "office", "garage", "bathroom", "hallway", "garden"]
TOPICS = ["technology", "sports", "science", "politics", "music", "health", "business", "space", "climate",
          "movies", "travel", "education"]
UNITS = {("km", "miles"): 0.621, ("miles", "km"): 1.609, ("kg", "pounds"): 2.205, ("pounds", "kg"): 0.454,
         ("meters", "feet"): 3.281, ("feet", "meters"): 0.305, ("liters", "gallons"): 0.264,
         ("inches", "cm"): 2.54, ("cm", "inches"): 0.394}
DIRS = ["src", "docs", "tests", "lib", "scripts", "engine", "app", "config", "data", "notes"]
EXTS = ["py", "md", "txt", "json", "toml", "yaml", "cfg", "rs", "js"]
SONGS = [("Bohemian Rhapsody", "Queen"), ("Imagine", "John Lennon"), ("Hey Jude", "The Beatles"),
         ("Hallelujah", "Leonard Cohen"), ("Yesterday", "The Beatles"), ("Respect", "Aretha Franklin"),
         ("Heroes", "David Bowie"), ("Clocks", "Coldplay"), ("Smells Like Teen Spirit", "Nirvana"),
         ("Dancing Queen", "ABBA"), ("Wonderwall", "Oasis"), ("Jolene", "Dolly Parton")]
DEFINITIONS = {"serendipity": "finding something good without looking for it",
               "ephemeral": "lasting a very short time", "ubiquitous": "found everywhere",
               "candid": "truthful and straightforward", "lucid": "clear and easy to understand",
               "meticulous": "very careful and precise", "resilient": "able to recover quickly",
               "verbose": "using more words than needed", "idempotent": "giving the same result when repeated",
               "latency": "the delay before a transfer of data begins", "recursion": "a function calling itself",
               "mutable": "able to be changed", "frugal": "careful with money", "benevolent": "kind and generous",
               "arcane": "known by only a few people", "pragmatic": "dealing with things sensibly"}
CONDITIONS = ["sunny", "cloudy", "rainy", "windy", "foggy", "snowy", "clear", "stormy"]


def made_up_word(r: random.Random, capital: bool = True) -> str:
    """A pronounceable word that is in no pool (so a copied argument cannot be remembered)."""
    word = "".join(r.choice(SYLLABLES) for _ in range(r.randint(2, 3)))
    return word.capitalize() if capital else word


def city(r: random.Random) -> str:
    return made_up_word(r) if r.random() < 0.3 else r.choice(CITIES)


def person(r: random.Random) -> str:
    return made_up_word(r) if r.random() < 0.3 else r.choice(NAMES)


def word(r: random.Random) -> str:
    return made_up_word(r, capital=False) if r.random() < 0.3 else r.choice(WORDS)


def file_path(r: random.Random) -> str:
    parts = [r.choice(DIRS)] if r.random() < 0.7 else []
    return "/".join(parts + [f"{word(r)}{r.choice(['', '_' + word(r)])}.{r.choice(EXTS)}"])


def phrase(r: random.Random, templates: list[str], **fills) -> str:
    return r.choice(templates).format(**fills)


def number_text(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}".rstrip("0").rstrip(".")


# ---------------------------------------------------------------- tools

@dataclass
class Tool:
    """A function the model may call: its OpenAI tool object, how a user asks for it (a request
    text and the arguments it means), what it returns, and the answer that reports the result."""
    name: str
    description: str
    properties: dict
    required: list[str]
    request: Callable[[random.Random], tuple[str, dict]]
    result: Callable[[random.Random, dict], object]
    answer: Callable[[random.Random, dict, object], str]

    def spec(self) -> dict:
        return {"type": "function", "function": {
            "name": self.name, "description": self.description,
            "parameters": {"type": "object", "properties": self.properties, "required": self.required}}}


def _s(description: str, **extra) -> dict:
    return {"type": "string", "description": description, **extra}


def _n(description: str, kind: str = "number", **extra) -> dict:
    return {"type": kind, "description": description, **extra}


def _weather_request(r):
    c = city(r)
    if r.random() < 0.3:
        u = r.choice(["celsius", "fahrenheit"])
        return phrase(r, ["What's the weather in {c} in {u}?", "Tell me the temperature in {c} in {u}.",
                          "How warm is it in {c}? Use {u}.", "Weather for {c}, in {u} please."], c=c, u=u), \
            {"city": c, "unit": u}
    return phrase(r, ["What's the weather in {c}?", "What is the weather like in {c} today?", "Is it raining in {c}?",
                      "How hot is it in {c} right now?", "weather in {c}", "Check the weather in {c} for me.",
                      "Do I need an umbrella in {c}?", "Tell me the weather in {c}."], c=c), {"city": c}


def _weather_result(r, a):
    unit = a.get("unit", "celsius")
    t = r.randint(-5, 35) if unit == "celsius" else r.randint(25, 95)
    return {"city": a["city"], "temperature": t, "unit": unit, "condition": r.choice(CONDITIONS)}


def _arith(op: str, word_: str, sym: str):
    def request(r):
        a, b = r.randint(1, 999), r.randint(1, 99)
        return phrase(r, ["What is {a} {w} {b}?", "Use the tool: {a} {s} {b}", "Can you compute {a} {w} {b}?",
                          "Please work out {a} {s} {b}.", "{a} {s} {b} = ?"], a=a, b=b, w=word_, s=sym), \
            {"a": a, "b": b}

    def result(r, a):
        x, y = a["a"], a["b"]
        return {"result": {"add": x + y, "subtract": x - y, "multiply": x * y}[op]}

    return request, result, lambda r, a, res: f"{a['a']} {sym} {a['b']} = {res['result']}."


_add, _add_result, _add_answer = _arith("add", "plus", "+")
_sub, _sub_result, _sub_answer = _arith("subtract", "minus", "-")
_mul, _mul_result, _mul_answer = _arith("multiply", "times", "*")


def _search_request(r):
    q = phrase(r, ["{w} recipes", "how to learn {l}", "best {w} in {c}", "history of {c}", "{w} {w2} tutorial",
                   "latest {t} news", "cheap flights to {c}", "{n} biography"],
               w=word(r), w2=word(r), l=r.choice(["Python", "Rust", "Go", "SQL", "Haskell", "C"]), c=city(r),
               t=r.choice(TOPICS), n=person(r))
    return phrase(r, ["Search the web for {q}.", "Look up {q}.", "Can you search for {q}?", "Find {q} online.",
                      "search: {q}"], q=q), {"query": q}


def _search_result(r, a):
    slug = a["query"].lower().replace(" ", "-")
    return {"results": [{"title": a["query"].title(), "url": f"https://example.com/{slug}"}]}


def _read_request(r):
    p = file_path(r)
    return phrase(r, ["Read {p}.", "Show me the contents of {p}.", "What is in {p}?",
                      "Open {p} and tell me what it says.", "cat {p}"], p=p), {"path": p}


def _read_result(r, a):
    return {"path": a["path"], "content": f"{word(r)} = {r.randint(0, 99)}\n{word(r)} = '{word(r)}'\n"}


def _write_request(r):
    p, text = file_path(r), f"{word(r)} {word(r)}"
    return phrase(r, ["Write '{t}' to {p}.", "Save the text '{t}' in {p}.", "Create {p} containing '{t}'.",
                      "Put '{t}' into the file {p}."], t=text, p=p), {"path": p, "content": text}


def _ls_request(r):
    d = r.choice(DIRS) if r.random() < 0.7 else made_up_word(r, capital=False)
    return phrase(r, ["What files are in {d}?", "List the directory {d}.", "ls {d}", "Show me what is inside {d}."],
                  d=d), {"path": d}


def _ls_result(r, a):
    return {"path": a["path"], "entries": sorted({f"{word(r)}.{r.choice(EXTS)}" for _ in range(r.randint(1, 3))})}


def _python_request(r):
    a, b = r.randint(1, 50), r.randint(1, 50)
    code = r.choice([f"print({a} + {b})", f"print({a} * {b})", f"print(len('{word(r)}'))",
                     f"print(sorted([{b}, {a}, {a + b}]))", f"print('{word(r)}'.upper())", f"print(max({a}, {b}))"])
    return phrase(r, ["Run this Python: {c}", "Execute {c}", "What does {c} print? Run it.",
                      "Please run the code {c}"], c=code), {"code": code}


_PY_CALLS = {"len": len, "sorted": sorted, "max": max}
_PY_OPS = {ast.Add: lambda x, y: x + y, ast.Mult: lambda x, y: x * y}


def _python_value(node: ast.AST):
    """The value of the expressions _python_request writes (constants, lists, + and *, len / sorted /
    max, str.upper), read from their syntax tree: the evaluation runs the code a model wrote, so it
    never reaches eval. ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, str)):
        return node.value
    if isinstance(node, ast.List):
        return [_python_value(e) for e in node.elts]
    if isinstance(node, ast.BinOp) and type(node.op) in _PY_OPS:
        return _PY_OPS[type(node.op)](_python_value(node.left), _python_value(node.right))
    if isinstance(node, ast.Call) and not node.keywords:
        if isinstance(node.func, ast.Name) and node.func.id in _PY_CALLS:
            return _PY_CALLS[node.func.id](*(_python_value(a) for a in node.args))
        if isinstance(node.func, ast.Attribute) and node.func.attr == "upper" and not node.args:
            return str(_python_value(node.func.value)).upper()
    raise ValueError(f"not a demo expression: {ast.dump(node)[:80]}")


def _python_result(r, a):
    call = ast.parse(a["code"], mode="eval").body
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "print"
            and len(call.args) == 1):
        raise ValueError(f"not print(expression): {a['code']!r}")
    return {"stdout": f"{_python_value(call.args[0])}\n"}


def _time_request(r):
    c = r.choice(list(TIMEZONES))
    return phrase(r, ["What time is it in {c}?", "Tell me the current time in {c}.", "time in {c}",
                      "What's the local time in {c}?"], c=c), {"timezone": TIMEZONES[c]}


def _time_result(r, a):
    return {"timezone": a["timezone"], "time": f"{r.randint(0, 23):02d}:{r.randint(0, 59):02d}"}


def _currency_request(r):
    src, dst = r.sample(sorted(CURRENCIES), 2)
    amount = r.choice([r.randint(1, 999), r.randint(1, 99) * 10])
    return phrase(r, ["Convert {x} {s} to {d}.", "How much is {x} {s} in {d}?", "{x} {s} in {d}?",
                      "What is {x} {s} worth in {d}?"], x=amount, s=src, d=dst), \
        {"amount": amount, "from_currency": src, "to_currency": dst}


def _currency_result(r, a):
    return {"amount": round(a["amount"] / CURRENCIES[a["from_currency"]] * CURRENCIES[a["to_currency"]], 2),
            "currency": a["to_currency"]}


def _units_request(r):
    (src, dst) = r.choice(sorted(UNITS))
    v = r.randint(1, 500)
    return phrase(r, ["Convert {v} {s} to {d}.", "How many {d} is {v} {s}?", "{v} {s} in {d}?"], v=v, s=src, d=dst), \
        {"value": v, "from_unit": src, "to_unit": dst}


def _units_result(r, a):
    return {"value": round(a["value"] * UNITS[(a["from_unit"], a["to_unit"])], 2), "unit": a["to_unit"]}


def _translate_request(r):
    text, lang = r.choice(sorted(PHRASES)), r.choice(LANGUAGES)
    return phrase(r, ["Translate '{t}' into {l}.", "How do you say '{t}' in {l}?", "What is '{t}' in {l}?",
                      "Translate to {l}: {t}"], t=text, l=lang), {"text": text, "target_language": lang}


def _translate_result(r, a):
    return {"translation": PHRASES[a["text"]][LANGUAGES.index(a["target_language"])]}


def _email_request(r):
    who = person(r)
    to, subject = f"{who.lower()}@example.com", r.choice(["Lunch", "Meeting", "Report", "Hello", "Tickets", "Update"])
    body = r.choice(["see you at noon", "the report is ready", "thanks for your help", "can we talk tomorrow",
                     "the build is green"])
    return phrase(r, ["Email {to} with the subject {s} saying {b}.", "Send an email to {to}, subject {s}: {b}",
                      "Write to {to} (subject: {s}) that {b}."], to=to, s=subject, b=body), \
        {"to": to, "subject": subject, "body": body}


def _timer_request(r):
    m = r.randint(1, 90)
    return phrase(r, ["Set a timer for {m} minutes.", "Start a {m} minute timer.", "Timer: {m} minutes",
                      "Remind me in {m} minutes."], m=m), {"minutes": m}


def _stock_request(r):
    s = r.choice(SYMBOLS)
    return phrase(r, ["What is {s} trading at?", "Get the stock price of {s}.", "How much is {s} stock?",
                      "price of {s}"], s=s), {"symbol": s}


def _define_request(r):
    w = r.choice(sorted(DEFINITIONS))
    return phrase(r, ["Define {w}.", "What does {w} mean?", "Look up the word {w}.", "What's the meaning of {w}?"],
                  w=w), {"word": w}


def _calc_request(r):
    a, b, c = r.randint(1, 20), r.randint(1, 20), r.randint(1, 9)
    e = r.choice([f"{a} * ({b} + {c})", f"({a} + {b}) * {c}", f"{a} * {b} - {c}", f"{a} + {b} + {c}",
                  f"{a * c} / {c}"])
    return phrase(r, ["Calculate {e}.", "Evaluate {e} for me.", "What is {e}? Use the calculator.",
                      "compute {e}"], e=e), {"expression": e}


def _user_request(r):
    i = r.randint(1, 9999)
    return phrase(r, ["Who is user {i}?", "Look up user {i}.", "Get the profile of user {i}.",
                      "Find the user with id {i}."], i=i), {"user_id": i}


def _date_request(r):
    return r.choice(["What's today's date?", "What day is it today?", "Tell me the date.", "date?",
                     "Which date is it?"]), {}


def _distance_request(r):
    a, b = r.sample(CITIES, 2)
    return phrase(r, ["How far is {a} from {b}?", "Distance from {a} to {b}?", "How many km from {a} to {b}?"],
                  a=a, b=b), {"origin": a, "destination": b}


def _random_request(r):
    lo = r.randint(0, 50)
    hi = lo + r.randint(1, 100)
    return phrase(r, ["Give me a random number between {a} and {b}.", "Pick a random number from {a} to {b}.",
                      "Roll a number between {a} and {b}."], a=lo, b=hi), {"min": lo, "max": hi}


def _population_request(r):
    c = r.choice(sorted(CAPITALS))
    return phrase(r, ["What is the population of {c}?", "How many people live in {c}?", "population of {c}"],
                  c=c), {"country": c}


def _music_request(r):
    song, artist = r.choice(SONGS)
    if r.random() < 0.5:
        return phrase(r, ["Play {s} by {a}.", "Put on {s} by {a}.", "I want to hear {s} by {a}."], s=song, a=artist), \
            {"song": song, "artist": artist}
    return phrase(r, ["Play {s}.", "Put on {s}.", "Can you play {s}?"], s=song), {"song": song}


def _lights_request(r):
    room, on = r.choice(ROOMS), r.random() < 0.5
    return phrase(r, ["Turn {o} the lights in the {x}.", "Switch {o} the {x} lights.",
                      "Lights {o} in the {x}, please."], o="on" if on else "off", x=room), {"room": room, "on": on}


def _thermostat_request(r):
    t = r.randint(16, 26)
    return phrase(r, ["Set the thermostat to {t} degrees.", "Make it {t} degrees in here.", "Thermostat to {t}."],
                  t=t), {"temperature": t}


def _news_request(r):
    t = r.choice(TOPICS)
    return phrase(r, ["What's the latest news about {t}?", "Any {t} news today?", "Get me the {t} headlines."], t=t), \
        {"topic": t}


def _shorten_request(r):
    url = f"https://{word(r)}.example.org/{word(r)}/{r.randint(1, 999)}"
    return phrase(r, ["Shorten {u}.", "Make a short link for {u}.", "Can you shorten this URL: {u}"], u=url), \
        {"url": url}


def _count_request(r):
    text = " ".join(word(r) for _ in range(r.randint(2, 7)))
    return phrase(r, ["How many words are in '{t}'?", "Count the words in: {t}", "Word count of '{t}'?"], t=text), \
        {"text": text}


def _issue_request(r):
    title = r.choice(["Crash on start", "Typo in the README", "Slow import", "Add dark mode", "Fix login bug",
                      f"{word(r).capitalize()} fails on empty input"])
    return phrase(r, ["Open an issue titled '{t}'.", "Create a GitHub issue: {t}", "File a bug called '{t}'."],
                  t=title), {"title": title}


def _grep_request(r):
    pattern, d = r.choice(["parse_args", "TODO", "import os", "def main", "self.cache", word(r)]), r.choice(DIRS)
    return phrase(r, ["Find '{p}' in {d}.", "Search the code in {d} for '{p}'.", "grep {p} in {d}"], p=pattern, d=d), \
        {"pattern": pattern, "path": d}


def _flight_request(r):
    a, b = r.sample(CITIES, 2)
    day = f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    return phrase(r, ["Book a flight from {a} to {b} on {d}.", "I need a flight {a} to {b} on {d}.",
                      "Find me a flight from {a} to {b}, date {d}."], a=a, b=b, d=day), \
        {"origin": a, "destination": b, "date": day}


TOOLS = [
    Tool("get_weather", "Get the current weather in a city.",
         {"city": _s("The city, e.g. Paris"), "unit": _s("Temperature unit", enum=["celsius", "fahrenheit"])},
         ["city"], _weather_request, _weather_result,
         lambda r, a, x: f"It is {x['temperature']} degrees {x['unit']} and {x['condition']} in {a['city']}."),
    Tool("add", "Add two numbers.", {"a": _n("First number"), "b": _n("Second number")}, ["a", "b"],
         _add, _add_result, _add_answer),
    Tool("subtract", "Subtract b from a.", {"a": _n("First number"), "b": _n("Second number")}, ["a", "b"],
         _sub, _sub_result, _sub_answer),
    Tool("multiply", "Multiply two numbers.", {"a": _n("First number"), "b": _n("Second number")}, ["a", "b"],
         _mul, _mul_result, _mul_answer),
    Tool("search_web", "Search the web and return the top results.", {"query": _s("The search query")}, ["query"],
         _search_request, _search_result,
         lambda r, a, x: f"The top result is {x['results'][0]['title']}: {x['results'][0]['url']}"),
    Tool("read_file", "Read a text file.", {"path": _s("Path of the file")}, ["path"], _read_request, _read_result,
         lambda r, a, x: f"{a['path']} says:\n{x['content'].rstrip()}"),
    Tool("write_file", "Write text to a file, replacing it.", {"path": _s("Path of the file"),
                                                                "content": _s("The text to write")},
         ["path", "content"], _write_request, lambda r, a: {"ok": True, "bytes": len(a["content"])},
         lambda r, a, x: f"Done: I wrote {x['bytes']} bytes to {a['path']}."),
    Tool("list_directory", "List the files in a directory.", {"path": _s("The directory")}, ["path"],
         _ls_request, _ls_result, lambda r, a, x: f"{a['path']} holds {', '.join(x['entries'])}."),
    Tool("run_python", "Run a Python snippet and return what it prints.", {"code": _s("Python source")}, ["code"],
         _python_request, _python_result, lambda r, a, x: f"It printed {x['stdout'].strip()}."),
    Tool("get_time", "Get the current time in a time zone.", {"timezone": _s("IANA time zone, e.g. Europe/Paris")},
         ["timezone"], _time_request, _time_result, lambda r, a, x: f"It is {x['time']} in {a['timezone']}."),
    Tool("convert_currency", "Convert an amount between currencies.",
         {"amount": _n("The amount"), "from_currency": _s("ISO code, e.g. USD"), "to_currency": _s("ISO code")},
         ["amount", "from_currency", "to_currency"], _currency_request, _currency_result,
         lambda r, a, x: f"{a['amount']} {a['from_currency']} is {number_text(x['amount'])} {x['currency']}."),
    Tool("convert_units", "Convert a value between units.",
         {"value": _n("The value"), "from_unit": _s("Unit to convert from"), "to_unit": _s("Unit to convert to")},
         ["value", "from_unit", "to_unit"], _units_request, _units_result,
         lambda r, a, x: f"{a['value']} {a['from_unit']} is {number_text(x['value'])} {x['unit']}."),
    Tool("translate", "Translate text into another language.",
         {"text": _s("The text"), "target_language": _s("The language to translate into")},
         ["text", "target_language"], _translate_request, _translate_result,
         lambda r, a, x: f"In {a['target_language']}, '{a['text']}' is '{x['translation']}'."),
    Tool("send_email", "Send an email.", {"to": _s("Recipient address"), "subject": _s("Subject line"),
                                          "body": _s("The message")},
         ["to", "subject", "body"], _email_request, lambda r, a: {"status": "sent"},
         lambda r, a, x: f"The email to {a['to']} was sent."),
    Tool("set_timer", "Start a countdown timer.", {"minutes": _n("Length in minutes", "integer", minimum=1)},
         ["minutes"], _timer_request, lambda r, a: {"ok": True, "minutes": a["minutes"]},
         lambda r, a, x: f"Your {a['minutes']} minute timer is running."),
    Tool("get_stock_price", "Get the latest price of a stock.", {"symbol": _s("Ticker symbol, e.g. AAPL")},
         ["symbol"], _stock_request, lambda r, a: {"symbol": a["symbol"], "price": round(r.uniform(5, 900), 2)},
         lambda r, a, x: f"{a['symbol']} is trading at {x['price']}."),
    Tool("define_word", "Look up the definition of an English word.", {"word": _s("The word")}, ["word"],
         _define_request, lambda r, a: {"word": a["word"], "definition": DEFINITIONS[a["word"]]},
         lambda r, a, x: f"{a['word'].capitalize()} means {x['definition']}."),
    Tool("calculate", "Evaluate an arithmetic expression.", {"expression": _s("The expression, e.g. 2 * (3 + 4)")},
         ["expression"], _calc_request, lambda r, a: {"result": number_text(eval(a["expression"], {}))},
         lambda r, a, x: f"{a['expression']} = {x['result']}."),
    Tool("get_user", "Get a user's profile by id.", {"user_id": _n("The user id", "integer")}, ["user_id"],
         _user_request, lambda r, a: {"id": a["user_id"], "name": person(r), "active": r.random() < 0.8},
         lambda r, a, x: f"User {a['user_id']} is {x['name']}."),
    Tool("get_current_date", "Get today's date.", {}, [], _date_request,
         lambda r, a: {"date": f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"},
         lambda r, a, x: f"Today is {x['date']}."),
    Tool("get_distance", "Get the distance between two cities in km.",
         {"origin": _s("Start city"), "destination": _s("End city")}, ["origin", "destination"],
         _distance_request, lambda r, a: {"km": r.randint(50, 15000)},
         lambda r, a, x: f"{a['origin']} is {x['km']} km from {a['destination']}."),
    Tool("random_number", "Draw a random integer between min and max.",
         {"min": _n("Lowest value", "integer"), "max": _n("Highest value", "integer")}, ["min", "max"],
         _random_request, lambda r, a: {"number": r.randint(a["min"], a["max"])},
         lambda r, a, x: f"Your number is {x['number']}."),
    Tool("get_population", "Get the population of a country.", {"country": _s("The country")}, ["country"],
         _population_request, lambda r, a: {"population": r.randint(300_000, 1_400_000_000)},
         lambda r, a, x: f"About {x['population']} people live in {a['country']}."),
    Tool("play_music", "Play a song.", {"song": _s("Song title"), "artist": _s("The artist")}, ["song"],
         _music_request, lambda r, a: {"playing": True},
         lambda r, a, x: f"Now playing {a['song']}" + (f" by {a['artist']}." if "artist" in a else ".")),
    Tool("set_lights", "Turn the lights of a room on or off.",
         {"room": _s("The room", enum=ROOMS), "on": {"type": "boolean", "description": "true: on, false: off"}},
         ["room", "on"], _lights_request, lambda r, a: {"ok": True},
         lambda r, a, x: f"The {a['room']} lights are {'on' if a['on'] else 'off'}."),
    Tool("set_thermostat", "Set the thermostat.", {"temperature": _n("Degrees celsius", minimum=10, maximum=30)},
         ["temperature"], _thermostat_request, lambda r, a: {"ok": True},
         lambda r, a, x: f"The thermostat is set to {a['temperature']} degrees."),
    Tool("get_news", "Get the latest headlines on a topic.", {"topic": _s("The topic")}, ["topic"], _news_request,
         lambda r, a: {"headlines": [f"{a['topic'].capitalize()}: {word(r)} {r.choice(['rises', 'falls', 'wins'])}"]},
         lambda r, a, x: f"The top {a['topic']} headline: {x['headlines'][0]}."),
    Tool("shorten_url", "Shorten a URL.", {"url": _s("The long URL")}, ["url"], _shorten_request,
         lambda r, a: {"short_url": f"https://sho.rt/{made_up_word(r, capital=False)}"},
         lambda r, a, x: f"Here is the short link: {x['short_url']}"),
    Tool("count_words", "Count the words in a text.", {"text": _s("The text")}, ["text"], _count_request,
         lambda r, a: {"words": len(a["text"].split())}, lambda r, a, x: f"It has {x['words']} words."),
    Tool("create_issue", "Open an issue in the project's tracker.", {"title": _s("Issue title"),
                                                                     "body": _s("Details")},
         ["title"], _issue_request, lambda r, a: {"number": r.randint(1, 999)},
         lambda r, a, x: f"Opened issue #{x['number']}: {a['title']}."),
    Tool("search_code", "Search the code for a pattern.", {"pattern": _s("Text to find"), "path": _s("Directory")},
         ["pattern"], _grep_request,
         lambda r, a: {"matches": [f"{a['path']}/{word(r)}.py:{r.randint(1, 300)}"]},
         lambda r, a, x: f"Found it at {x['matches'][0]}."),
    Tool("book_flight", "Book a flight.", {"origin": _s("From city"), "destination": _s("To city"),
                                           "date": _s("Date, YYYY-MM-DD")},
         ["origin", "destination", "date"], _flight_request,
         lambda r, a: {"booking": f"{made_up_word(r, capital=False).upper()}{r.randint(10, 99)}",
                       "status": "confirmed"},
         lambda r, a, x: f"Booked: {a['origin']} to {a['destination']} on {a['date']}, reference {x['booking']}."),
]
TOOLS_BY_NAME = {t.name: t for t in TOOLS}


# ---------------------------------------------------------------- plain chat

SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are a concise assistant. Keep answers short.",
                  "You are a coding assistant.", "Answer briefly.", "You are a friendly assistant.",
                  "Be helpful and precise.", "You are an assistant that ships with agent-infer."]
GREETINGS = ["Hi", "Hello", "Hey", "Hi there!", "Hello!", "Good morning", "Good evening", "hey", "hello there",
             "Howdy", "Hi, how are you?", "Hello, anyone there?", "Greetings", "yo"]
GREETING_ANSWERS = ["Hello! How can I help you today?", "Hi! What can I do for you?", "Hello! How can I help?"]
THANKS = ["Thanks!", "Thank you", "thanks a lot", "Great, thanks.", "Perfect, thank you!", "ok thanks", "Cool, thanks!"]
THANKS_ANSWERS = ["You're welcome!", "Glad I could help!", "Any time!"]
BYES = ["Bye", "Goodbye!", "See you later", "bye for now", "That's all, bye."]
PYTHON_HOWTO = {
    "reverse a list": "Use `xs[::-1]`, or `xs.reverse()` to reverse it in place.",
    "sort a list": "Use `sorted(xs)` for a new list or `xs.sort()` in place.",
    "get the length of a list": "Use `len(xs)`.",
    "read a file": "Use `with open(path) as f: text = f.read()`.",
    "write a file": "Use `with open(path, 'w') as f: f.write(text)`.",
    "join strings": "Use `', '.join(words)`.",
    "split a string": "Use `text.split()`, or `text.split(',')` for a separator.",
    "make a string uppercase": "Use `text.upper()`.",
    "check if a key is in a dict": "Use `key in d`.",
    "loop over a dict": "Use `for key, value in d.items():`.",
    "remove duplicates from a list": "Use `list(dict.fromkeys(xs))` to keep the order.",
    "parse JSON": "Use `json.loads(text)`.",
    "get the current time": "Use `datetime.datetime.now()`.",
    "sum a list": "Use `sum(xs)`.",
    "find the largest item": "Use `max(xs)`.",
    "count items": "Use `collections.Counter(xs)`.",
    "copy a list": "Use `xs.copy()` or `list(xs)`.",
    "convert a string to an int": "Use `int(text)`.",
    "make a directory": "Use `os.makedirs(path, exist_ok=True)`.",
    "list files in a folder": "Use `os.listdir(path)`.",
    "run a shell command": "Use `subprocess.run(cmd, check=True)`.",
    "sleep for a second": "Use `time.sleep(1)`.",
    "generate a random number": "Use `random.randint(a, b)`.",
    "format a number with two decimals": "Use `f'{x:.2f}'`.",
    "merge two dicts": "Use `{**a, **b}` or `a | b`.",
}
FUNCTIONS = {
    "returns the sum of a list": "def total(xs):\n    return sum(xs)",
    "adds two numbers": "def add(a, b):\n    return a + b",
    "checks if a number is even": "def is_even(n):\n    return n % 2 == 0",
    "reverses a string": "def reverse(s):\n    return s[::-1]",
    "returns the largest of three numbers": "def largest(a, b, c):\n    return max(a, b, c)",
    "squares a number": "def square(x):\n    return x * x",
    "counts the vowels in a string": "def vowels(s):\n    return sum(c in 'aeiou' for c in s.lower())",
    "returns the first item of a list": "def first(xs):\n    return xs[0]",
    "computes a factorial": "def factorial(n):\n    return 1 if n < 2 else n * factorial(n - 1)",
    "checks if a string is a palindrome": "def is_palindrome(s):\n    return s == s[::-1]",
    "returns the average of a list": "def mean(xs):\n    return sum(xs) / len(xs)",
    "greets a person by name": "def greet(name):\n    return f'Hello, {name}!'",
    "doubles every item of a list": "def double(xs):\n    return [2 * x for x in xs]",
    "returns the last character of a string": "def last(s):\n    return s[-1]",
    "converts celsius to fahrenheit": "def to_fahrenheit(c):\n    return c * 9 / 5 + 32",
    "fetches the n-th fibonacci number": "def fib(n):\n    a, b = 0, 1\n    for _ in range(n):\n"
                                         "        a, b = b, a + b\n    return a",
}


@dataclass
class Turn:
    """One exchange: the user's message and what the assistant writes back (a one-line thought for
    thinking mode, the text, and/or one call: (tool, arguments), then the tool's result and the
    text of the answer)."""
    user: str
    thought: str
    text: str = ""
    call: tuple[Tool, dict] | None = None
    result: object = None
    after: str = ""  # the answer after the result
    after_thought: str = ""


def _qa(r: random.Random, system: str | None) -> Turn:
    """A one-exchange question with a short answer."""
    kind = r.choices(["greet", "who", "capital", "sum", "antonym", "repeat", "count", "howto", "function", "thanks",
                      "bye", "fact"], weights=[2, 1, 4, 3, 3, 3, 2, 3, 3, 1, 1, 2])[0]
    if kind == "greet":
        return Turn(r.choice(GREETINGS), "The user greets me.", r.choice(GREETING_ANSWERS))
    if kind == "who":
        bot = next((b for b in BOT_NAMES if system and b in system), None)
        answer = (f"I am {bot}, a small assistant." if bot else
                  "I am a tiny demo model that ships with agent-infer, trained on Python code.")
        return Turn(r.choice(["Who are you?", "What is your name?", "What are you?", "Introduce yourself."]),
                    "The user asks who I am.", answer)
    if kind == "capital":
        country = r.choice(sorted(CAPITALS))
        return Turn(phrase(r, ["What is the capital of {c}?", "capital of {c}?", "Which city is the capital of {c}?",
                               "Tell me the capital of {c}.", "What's {c}'s capital?"], c=country),
                    f"The user asks for the capital of {country}.", f"The capital of {country} is {CAPITALS[country]}.")
    if kind == "sum":
        a, b = r.randint(0, 9), r.randint(0, 9)
        return Turn(phrase(r, ["What is {a} + {b}?", "What is {a} plus {b}?", "{a} + {b} = ?", "Add {a} and {b}.",
                               "How much is {a} plus {b}?"], a=a, b=b), f"I need {a} + {b}.", f"{a} + {b} = {a + b}.")
    if kind == "antonym":
        w = r.choice(sorted(ANTONYMS))
        return Turn(phrase(r, ["What is the opposite of {w}?", "Give me an antonym of '{w}'.", "opposite of {w}?",
                               "What's the opposite of '{w}'?"], w=w),
                    "The user wants an antonym.", f"The opposite of '{w}' is '{ANTONYMS[w]}'.")
    if kind == "repeat":
        said = " ".join(word(r) for _ in range(r.randint(1, 5)))
        return Turn(phrase(r, ["Repeat after me: {s}", "Say '{s}'.", "Please repeat: {s}", "Echo this: {s}"], s=said),
                    "The user wants me to repeat some words.", said)
    if kind == "count":
        n = r.randint(2, 10)
        return Turn(phrase(r, ["Count from 1 to {n}.", "Count to {n}.", "Please count up to {n}."], n=n),
                    f"I count from 1 to {n}.", ", ".join(str(i) for i in range(1, n + 1)) + ".")
    if kind == "howto":
        task = r.choice(sorted(PYTHON_HOWTO))
        return Turn(phrase(r, ["How do I {t} in Python?", "How can I {t} in Python?", "Python: how to {t}?",
                               "What's the best way to {t} in Python?"], t=task),
                    "This is a Python question.", PYTHON_HOWTO[task])
    if kind == "function":
        what = r.choice(sorted(FUNCTIONS))
        return Turn(phrase(r, ["Write a Python function that {w}.", "Give me a function that {w}.",
                               "Can you write a function that {w}?", "I need a Python function that {w}."], w=what),
                    "The user wants a short Python function.", f"```python\n{FUNCTIONS[what]}\n```")
    if kind == "thanks":
        return Turn(r.choice(THANKS), "The user thanks me.", r.choice(THANKS_ANSWERS))
    if kind == "bye":
        return Turn(r.choice(BYES), "The user says goodbye.", "Goodbye! Have a nice day.")
    fact, answer = r.choice([("What color is the sky?", "The sky is blue on a clear day."),
                             ("How many days are in a week?", "A week has 7 days."),
                             ("How many legs does a spider have?", "A spider has 8 legs."),
                             ("What is water made of?", "Water is made of hydrogen and oxygen: H2O."),
                             ("What language are you trained on?", "Mostly Python code from the standard library."),
                             ("What is Python?", "Python is a popular programming language."),
                             ("How many minutes are in an hour?", "An hour has 60 minutes."),
                             ("What is the boiling point of water?", "Water boils at 100 degrees celsius."),
                             ("Which planet is the largest?", "Jupiter is the largest planet."),
                             ("How many continents are there?", "There are 7 continents.")])
    return Turn(fact, "A short fact answers this.", answer)


def _follow_ups(r: random.Random, first: Turn, system: str | None) -> list[Turn]:
    """A few more exchanges after ``first`` (some depend on it: a name to remember, another capital)."""
    turns = [first]
    for _ in range(r.choice([0, 0, 1, 1, 2])):
        last = turns[-1]
        if last.text.startswith("The capital of") and r.random() < 0.6:
            country = r.choice(sorted(CAPITALS))
            turns.append(Turn(phrase(r, ["And {c}?", "What about {c}?", "And the capital of {c}?"], c=country),
                              f"Now the user asks about {country}.",
                              f"The capital of {country} is {CAPITALS[country]}."))
        elif r.random() < 0.3:
            turns.append(Turn(r.choice(THANKS), "The user thanks me.", r.choice(THANKS_ANSWERS)))
        else:
            turns.append(_qa(r, system))
    return turns


def _name_turns(r: random.Random) -> list[Turn]:
    """The user says their name; later the assistant is asked for it."""
    name = person(r)
    turns = [Turn(phrase(r, ["My name is {n}.", "Hi, I'm {n}.", "Call me {n}.", "I am {n}."], n=name),
                  f"The user's name is {name}.", f"Nice to meet you, {name}!")]
    if r.random() < 0.5:
        turns.append(_qa(r, None))
    turns.append(Turn(r.choice(["What is my name?", "Do you remember my name?", "What's my name?", "Who am I?"]),
                      "The user told me their name earlier.", f"Your name is {name}."))
    return turns


# ---------------------------------------------------------------- conversations

@dataclass
class Conversation:
    """Messages in the OpenAI chat format (assistant turns included), the tools, whether thinking
    is on, and ``targets``: the index of each assistant message -> the text the model writes for it
    (its thought in a <think> block first when thinking is on; a call as a hermes block)."""
    messages: list[dict]
    tools: list[dict] | None
    thinking: bool
    kind: str
    targets: dict[int, str] = field(default_factory=dict)
    tool: str | None = None            # the tool the user asks for (tool conversations)
    arguments: dict | None = None      # the arguments that request means

    def prompt_messages(self, index: int) -> list[dict]:
        """The messages before assistant message ``index`` (what the model is prompted with)."""
        return self.messages[:index]


def split_of(user: str) -> str:
    """'test' (one in HELD_OUT_BUCKETS) or 'train', fixed by blake2b of a conversation's first user message."""
    digest = hashlib.blake2b(user.encode(), digest_size=8).digest()
    return "test" if int.from_bytes(digest, "big") % HELD_OUT_BUCKETS == 0 else "train"


def _call_block(name: str, arguments: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def _with_thought(thinking: bool, thought: str, body: str) -> str:
    return f"<think>\n{thought}\n</think>\n\n{body}" if thinking else body


def _assistant_message(r: random.Random, thinking: bool, thought: str, content: str | None,
                       calls: list[dict] | None = None) -> dict:
    """The assistant message as a client sends it back: in thinking mode with the thought as
    ``reasoning_content``, left in the content, or dropped (clients do all three)."""
    m = {"role": "assistant", "content": content}
    if calls:
        m["tool_calls"] = calls
    if thinking:
        how = r.random()
        if how < 0.4:
            m["reasoning_content"] = thought
        elif how < 0.6:
            m["content"] = f"<think>\n{thought}\n</think>\n\n{content or ''}"
    return m


def _system(r: random.Random) -> str | None:
    x = r.random()
    if x < 0.45:
        return None
    if x < 0.6:
        return f"You are {r.choice(BOT_NAMES)}, a helpful assistant."
    return r.choice(SYSTEM_PROMPTS)


def chat_conversation(r: random.Random, thinking: bool) -> Conversation:
    system = _system(r)
    turns = _name_turns(r) if r.random() < 0.12 else _follow_ups(r, _qa(r, system), system)
    messages = [{"role": "system", "content": system}] if system else []
    conv = Conversation(messages, None, thinking, "chat")
    for t in turns:
        messages.append({"role": "user", "content": t.user})
        conv.targets[len(messages)] = _with_thought(thinking, t.thought, t.text)
        messages.append(_assistant_message(r, thinking, t.thought, t.text))
    return conv


def tool_conversation(r: random.Random, thinking: bool, n_tools: int | None = None,
                      direct: bool | None = None, direct_share: float = 0.15) -> Conversation:
    """Tools in the system turn and a user asking for what one does (the call, its result, the
    answer), or (``direct``; None: with probability ``direct_share``) a question none of them is
    for, answered directly."""
    n_tools = n_tools or r.choice([1, 1, 1, 2, 2])
    direct = r.random() < direct_share if direct is None else direct
    chosen = r.sample(TOOLS, n_tools)
    tools = [t.spec() for t in chosen]
    system = _system(r) if r.random() < 0.6 else None
    messages = [{"role": "system", "content": system}] if system else []
    if direct:
        t = _qa(r, system)
        t = Turn(t.user, "No tool is needed for this.", t.text)
        conv = Conversation(messages, tools, thinking, "tool-direct")
        messages.append({"role": "user", "content": t.user})
        conv.targets[len(messages)] = _with_thought(thinking, t.thought, t.text)
        messages.append(_assistant_message(r, thinking, t.thought, t.text))
        return conv
    tool = r.choice(chosen)
    user, arguments = tool.request(r)
    result = tool.result(r, arguments)
    conv = Conversation(messages, tools, thinking, "tool", tool=tool.name, arguments=arguments)
    messages.append({"role": "user", "content": user})
    thought = f"I should call {tool.name}."
    conv.targets[len(messages)] = _with_thought(thinking, thought, _call_block(tool.name, arguments))
    compact = r.random() < 0.5  # the server returns arguments compact; clients send them back either way
    written = json.dumps(arguments, ensure_ascii=False, separators=(",", ":") if compact else None)
    call_id = "call_" + "".join(r.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8))
    calls = [{"id": call_id, "type": "function", "function": {"name": tool.name, "arguments": written}}]
    messages.append(_assistant_message(r, thinking, thought, None, calls))
    messages.append({"role": "tool", "tool_call_id": call_id, "content": json.dumps(result, ensure_ascii=False)})
    after_thought = f"{tool.name} returned its result."
    answer = tool.answer(r, arguments, result)
    conv.targets[len(messages)] = _with_thought(thinking, after_thought, answer)
    messages.append(_assistant_message(r, thinking, after_thought, answer))
    return conv


def conversations(seed: int, count: int, split: str = "train", kinds: tuple[str, ...] = ("chat", "tool"),
                  tool_share: float = 0.5, **tool_options) -> list[Conversation]:
    """``count`` conversations of ``split`` drawn from ``seed`` (those of the other split skipped);
    thinking on for half of them."""
    r = random.Random(seed)
    out = []
    while len(out) < count:
        thinking = r.random() < 0.5
        if "tool" in kinds and ("chat" not in kinds or r.random() < tool_share):
            conv = tool_conversation(r, thinking, **tool_options)
        else:
            conv = chat_conversation(r, thinking)
        first_user = next(m["content"] for m in conv.messages if m["role"] == "user")
        if split_of(first_user) == split:
            out.append(conv)
    return out
