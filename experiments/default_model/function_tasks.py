"""General-purpose function calling for the agent model, beside tasks.py's
record tools (get/cancel/update an order by its id): functions over numbers,
places, dates and text, the way public tool-calling APIs are used.

- typed arguments: integers stay integers, decimals numbers, lists lists,
  strings exactly as the request words them; optional parameters are passed
  only when the request gives them;
- one fitting function among others from other domains (the choice is the
  point), several calls in one reply (two requests in one message), and
  requests that no offered function fits, declined in text, next to the
  same kind of request with a function that fits (so the offered functions
  decide, not the wording);
- a fifth of the functions (by hash) are held out: never in a training
  episode, used by the held-out evaluation.

The catalogue was written here from general knowledge; no benchmark's items
were read for it. No torch here (data workers import it).
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from functools import lru_cache

from agentkv.experiments.default_model.tasks import (
    CITIES, CLOSERS, OPENERS, WORDS, Episode, _call, _messages_start, _person, stable_hash,
)

HELDOUT_FUNCTION_PERCENT = 20

CURRENCIES = ("USD", "EUR", "JPY", "GBP", "CHF", "CAD", "AUD", "SEK")
TICKERS = ("ACME", "GLBX", "INTC", "NWND", "HOOL", "UMBR", "STRK", "VNDL")
LANGUAGES = ("French", "German", "Spanish", "Japanese", "Italian", "Portuguese", "Korean", "Dutch")
FOODS = ("chicken", "lentils", "tofu", "salmon", "spinach", "mushrooms", "chickpeas", "rice", "eggs", "broccoli")
ACTIVITIES = ("running", "cycling", "swimming", "walking", "rowing", "yoga")
LEAGUES = ("Premier League", "NBA", "La Liga", "Serie A", "NHL", "Bundesliga")
UNITS = (("km", "miles"), ("kg", "pounds"), ("celsius", "fahrenheit"), ("liters", "gallons"), ("meters", "feet"))
FORMULAS = ("H2O", "CO2", "NaCl", "C6H12O6", "NH3", "CH4", "H2SO4")
GENRES = ("jazz", "rock", "classical", "hip hop", "folk", "electronic")
SONGS = ("Blue Harbor", "Paper Moons", "Quiet Engines", "Northern Lights", "Glass Rivers")


def _num(r: random.Random) -> float | int:
    return r.randint(2, 250) if r.random() < 0.6 else round(r.uniform(0.5, 99), r.choice([1, 2]))


VALUES = {
    "num": _num,
    "small_int": lambda r: r.randint(2, 12),
    "int": lambda r: r.randint(2, 400),
    "year": lambda r: r.randint(2015, 2025),
    "rate": lambda r: round(r.uniform(1, 9), r.choice([1, 2])),
    "height": lambda r: round(r.uniform(1.45, 2.05), 2),
    "money": lambda r: r.choice([r.randint(5, 900) * 100, r.randint(10, 9999)]),
    "city": lambda r: r.choice(CITIES),
    "currency": lambda r: r.choice(CURRENCIES),
    "ticker": lambda r: r.choice(TICKERS),
    "language": lambda r: r.choice(LANGUAGES),
    "food": lambda r: r.choice(FOODS),
    "activity": lambda r: r.choice(ACTIVITIES),
    "league": lambda r: r.choice(LEAGUES),
    "formula": lambda r: r.choice(FORMULAS),
    "genre": lambda r: r.choice(GENRES),
    "song": lambda r: r.choice(SONGS),
    "person": _person,
    "date": lambda r: f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}",
    "phrase": lambda r: " ".join(r.sample(WORDS, r.randint(2, 4))),
    "numbers": lambda r: [r.randint(1, 99) for _ in range(r.randint(3, 6))],
    "bool": lambda r: True,
}
JSON_TYPES = {"num": "number", "rate": "number", "height": "number", "small_int": "integer", "int": "integer", "year": "integer",
              "money": "number", "numbers": "array", "bool": "boolean"}


@dataclass(frozen=True)
class Param:
    name: str
    kind: str  # a key of VALUES
    description: str
    optional: str = ""  # the phrase that gives it ("" : required), with {v}


@dataclass(frozen=True)
class Function:
    name: str
    domain: str
    description: str
    params: tuple[Param, ...]
    requests: tuple[str, ...]  # phrasings with {param} for each required parameter
    decline: str  # what it does, for a reply that no offered function fits ("convert currencies")

    def schema(self) -> dict:
        props = {}
        for p in self.params:
            t = JSON_TYPES.get(p.kind, "string")
            props[p.name] = {"type": t, "description": p.description}
            if t == "array":
                props[p.name]["items"] = {"type": "integer"}
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": {
            "type": "object", "properties": props, "required": [p.name for p in self.params if not p.optional]}}}


def _p(name: str, kind: str, description: str, optional: str = "") -> Param:
    return Param(name, kind, description, optional)


CATALOGUE = (
    Function("rectangle_area", "geometry", "Area of a rectangle.",
             (_p("length", "num", "Length of the rectangle."), _p("width", "num", "Width of the rectangle.")),
             ("What is the area of a rectangle {length} by {width}?",
              "Calculate the area of a rectangle with length {length} and width {width}.",
              "A room is {length} long and {width} wide. How big is its floor area?"), "compute areas"),
    Function("circle_circumference", "geometry", "Circumference of a circle from its radius.",
             (_p("radius", "num", "The circle's radius."),),
             ("What's the circumference of a circle with radius {radius}?",
              "Find the perimeter of a circle whose radius is {radius}."), "measure circles"),
    Function("cylinder_volume", "geometry", "Volume of a cylinder.",
             (_p("radius", "num", "Radius of the base."), _p("height", "num", "Height of the cylinder.")),
             ("Compute the volume of a cylinder with radius {radius} and height {height}.",
              "How much does a cylindrical tank hold if it is {height} high with a radius of {radius}?"),
             "compute volumes"),
    Function("loan_monthly_payment", "finance", "Monthly payment of a fixed-rate loan.",
             (_p("principal", "money", "Amount borrowed."), _p("annual_rate", "rate", "Yearly interest rate in percent."),
              _p("years", "small_int", "Term of the loan in years.")),
             ("What would I pay each month on a loan of {principal} at {annual_rate}% over {years} years?",
              "Calculate the monthly payment for borrowing {principal} for {years} years at an annual rate of "
              "{annual_rate} percent."), "calculate loan payments"),
    Function("compound_interest", "finance", "Value of a deposit after compound interest.",
             (_p("principal", "money", "Initial deposit."), _p("rate", "rate", "Yearly rate in percent."),
              _p("years", "small_int", "Number of years."),
              _p("compounds_per_year", "small_int", "Times interest is added per year.", "compounded {v} times a year")),
             ("If I deposit {principal} at {rate}% for {years} years, how much will I have?",
              "Work out the future value of {principal} invested for {years} years at {rate} percent interest."),
             "compute interest"),
    Function("convert_currency", "finance", "Convert an amount between currencies at today's rate.",
             (_p("amount", "money", "Amount to convert."), _p("from_currency", "currency", "Currency code of the amount."),
              _p("to_currency", "currency", "Currency code to convert to.")),
             ("Convert {amount} {from_currency} to {to_currency}.", "How much is {amount} {from_currency} in "
              "{to_currency}?"), "convert currencies"),
    Function("stock_quote", "finance", "Latest price of a stock.",
             (_p("ticker", "ticker", "Stock ticker symbol."),
              _p("include_history", "bool", "Also return the last 30 days.", "with its recent history")),
             ("What's {ticker} trading at right now?", "Get me the current stock price of {ticker}."),
             "look up stock prices"),
    Function("weather_forecast", "weather", "Weather forecast for a city.",
             (_p("city", "city", "City name."), _p("days", "small_int", "Number of days ahead.", "for the next {v} days")),
             ("What's the weather going to be like in {city}?", "Will it rain in {city}?",
              "Give me the forecast for {city}."), "give weather forecasts"),
    Function("air_quality_index", "weather", "Current air quality index of a city.",
             (_p("city", "city", "City name."),),
             ("How clean is the air in {city} today?", "What's the AQI in {city}?"), "report air quality"),
    Function("search_flights", "travel", "Search flights between two cities on a date.",
             (_p("origin", "city", "Departure city."), _p("destination", "city", "Arrival city."),
              _p("date", "date", "Departure date, YYYY-MM-DD.")),
             ("Find flights from {origin} to {destination} on {date}.",
              "I need to fly {origin} to {destination} on {date}. What are my options?"), "search flights"),
    Function("find_hotels", "travel", "Hotels available in a city.",
             (_p("city", "city", "City name."), _p("nights", "small_int", "Number of nights."),
              _p("max_price", "money", "Highest price per night.", "under {v} a night")),
             ("Find me a hotel in {city} for {nights} nights.", "Look for places to stay in {city}, {nights} nights."),
             "book hotels"),
    Function("find_recipes", "food", "Recipes that use an ingredient.",
             (_p("ingredient", "food", "Main ingredient."),
              _p("max_minutes", "int", "Longest cooking time in minutes.", "ready in under {v} minutes")),
             ("Suggest a recipe with {ingredient}.", "What can I cook with {ingredient}?"), "find recipes"),
    Function("nutrition_facts", "food", "Calories and macronutrients of a food portion.",
             (_p("food", "food", "The food."), _p("grams", "int", "Portion in grams.")),
             ("How many calories are in {grams} grams of {food}?", "Nutrition facts for {grams} g of {food}, please."),
             "give nutrition facts"),
    Function("convert_units", "science", "Convert a value between units.",
             (_p("value", "num", "The value."), _p("from_unit", "unit_from", "Unit of the value."),
              _p("to_unit", "unit_to", "Unit to convert to.")),
             ("Convert {value} {from_unit} to {to_unit}.", "How many {to_unit} is {value} {from_unit}?"),
             "convert units"),
    Function("molar_mass", "science", "Molar mass of a chemical formula in g/mol.",
             (_p("formula", "formula", "Chemical formula."),),
             ("What is the molar mass of {formula}?", "Calculate the molecular weight of {formula}."),
             "compute molar masses"),
    Function("average_speed", "science", "Average speed from distance and time.",
             (_p("distance_km", "num", "Distance in kilometres."), _p("hours", "num", "Time taken in hours.")),
             ("I drove {distance_km} km in {hours} hours. What was my average speed?",
              "Average speed for {distance_km} kilometres covered in {hours} h?"), "compute speeds"),
    Function("mean_of", "statistics", "Arithmetic mean of a list of numbers.",
             (_p("numbers", "numbers", "The numbers."),),
             ("What's the average of {numbers}?", "Compute the mean of these values: {numbers}."), "average numbers"),
    Function("standard_deviation", "statistics", "Standard deviation of a list of numbers.",
             (_p("numbers", "numbers", "The numbers."),),
             ("Find the standard deviation of {numbers}.", "How spread out are {numbers}? Give the std dev."),
             "compute statistics"),
    Function("greatest_common_divisor", "math", "Greatest common divisor of two integers.",
             (_p("a", "int", "First integer."), _p("b", "int", "Second integer.")),
             ("What is the GCD of {a} and {b}?", "Find the greatest common divisor of {a} and {b}."),
             "compute divisors"),
    Function("factorial", "math", "Factorial of a non-negative integer.",
             (_p("n", "small_int", "The integer."),),
             ("What is {n} factorial?", "Compute {n}!"), "compute factorials"),
    Function("league_standings", "sports", "Table of a sports league for a season.",
             (_p("league", "league", "League name."), _p("season", "year", "Season year.")),
             ("Show the {league} standings for {season}.", "Who topped the {league} in {season}?"),
             "report sports standings"),
    Function("player_statistics", "sports", "Season statistics of a player.",
             (_p("player", "person", "Player's full name."), _p("season", "year", "Season year.")),
             ("Get {player}'s stats for the {season} season.", "How did {player} do in {season}?"),
             "look up player statistics"),
    Function("translate_text", "language", "Translate text into another language.",
             (_p("text", "phrase", "Text to translate."), _p("target_language", "language", "Language to translate into.")),
             ("Translate \"{text}\" into {target_language}.", "How do you say \"{text}\" in {target_language}?"),
             "translate text"),
    Function("days_between", "calendar", "Number of days between two dates.",
             (_p("start_date", "date", "First date, YYYY-MM-DD."), _p("end_date", "date", "Second date, YYYY-MM-DD.")),
             ("How many days are there between {start_date} and {end_date}?",
              "Count the days from {start_date} to {end_date}."), "count days between dates"),
    Function("create_calendar_event", "calendar", "Add an event to the user's calendar.",
             (_p("title", "phrase", "Event title."), _p("date", "date", "Date, YYYY-MM-DD."),
              _p("attendee", "person", "Someone to invite.", "and invite {v}")),
             ("Put \"{title}\" on my calendar for {date}.", "Schedule an event called \"{title}\" on {date}."),
             "manage the calendar"),
    Function("recommend_songs", "music", "Song recommendations for a genre.",
             (_p("genre", "genre", "Music genre."), _p("count", "small_int", "How many songs.", "{v} of them")),
             ("Recommend some {genre} songs.", "I'm in the mood for {genre}. Any song suggestions?"),
             "recommend music"),
    Function("song_lyrics", "music", "Lyrics of a song.",
             (_p("title", "song", "Song title."), _p("artist", "person", "Performer.")),
             ("Show me the lyrics of \"{title}\" by {artist}.", "What are the words to {artist}'s \"{title}\"?"),
             "find lyrics"),
    Function("body_mass_index", "health", "Body mass index from weight and height.",
             (_p("weight_kg", "num", "Weight in kilograms."), _p("height_m", "height", "Height in metres.")),
             ("What's the BMI of someone who weighs {weight_kg} kg and is {height_m} m tall?",
              "Calculate BMI for weight {weight_kg} kg, height {height_m} m."), "compute BMI"),
    Function("calories_burned", "health", "Calories burned by an activity.",
             (_p("activity", "activity", "The activity."), _p("minutes", "int", "Duration in minutes.")),
             ("How many calories does {minutes} minutes of {activity} burn?",
              "Estimate the calories I burned {activity} for {minutes} minutes."), "estimate calories burned"),
)
NAME_PREFIXES = {"geometry": "geo", "finance": "fin", "weather": "wx", "travel": "travel", "food": "food",
                 "science": "sci", "statistics": "stats", "math": "math", "sports": "sports", "language": "lang",
                 "calendar": "cal", "music": "music", "health": "health"}


@lru_cache(maxsize=1)
def heldout_functions() -> frozenset[str]:
    return frozenset(f.name for f in CATALOGUE if stable_hash("function:" + f.name) % 100 < HELDOUT_FUNCTION_PERCENT)


def _named(f: Function, r: random.Random) -> Function:
    """The function under one of a few naming conventions (module prefix, camelCase)."""
    style = r.random()
    if style < 0.5:
        return f
    if style < 0.8:
        name = f"{NAME_PREFIXES[f.domain]}_{f.name}"
    else:
        head, *rest = f.name.split("_")
        name = head + "".join(w.title() for w in rest)
    return Function(name, f.domain, f.description, f.params, f.requests, f.decline)


def _fmt(value) -> str:
    if isinstance(value, list):
        return ", ".join(map(str, value))
    return str(value)


def _draw(f: Function, r: random.Random) -> tuple[str, dict]:
    """A request for f and the arguments that answer it."""
    args: dict = {}
    units = r.choice(UNITS)
    for p in f.params:
        if p.kind == "unit_from":
            args[p.name] = units[0]
        elif p.kind == "unit_to":
            args[p.name] = units[1]
        else:
            args[p.name] = VALUES[p.kind](r)
    if "from_currency" in args:
        args["to_currency"] = r.choice([c for c in CURRENCIES if c != args["from_currency"]])
    if "destination" in args:
        args["destination"] = r.choice([c for c in CITIES if c != args["origin"]])
    text = r.choice(f.requests).format(**{k: _fmt(v) for k, v in args.items()})
    for p in f.params:
        if p.optional and r.random() < 0.4:
            text = text.rstrip("?.!") + " " + p.optional.format(v=_fmt(args[p.name])) + text[-1:]
        elif p.optional:
            del args[p.name]
    return text, args


def _functions(arg_ok, heldout: bool) -> list[Function]:
    held = heldout_functions()
    return [f for f in CATALOGUE if (f.name in held) == heldout and arg_ok(f.name)
            and all(arg_ok(p.name) for p in f.params)]


def _others(r: random.Random, pool: list[Function], exclude: Function, n: int) -> list[Function]:
    """Functions of other domains (one of the same domain now and then: both must be read)."""
    cands = [f for f in pool if f.domain != exclude.domain or (f is not exclude and r.random() < 0.3)]
    cands = [f for f in cands if f is not exclude]
    return r.sample(cands, min(n, len(cands)))


def _user(r: random.Random, text: str) -> dict:
    opener = r.choice(OPENERS)
    body = text[0].lower() + text[1:] if opener and not opener.endswith(". ") else text
    return {"role": "user", "content": opener + body + r.choice(CLOSERS)}


def function_episode(r: random.Random, arg_ok, heldout: frozenset[str], eval_set: bool = False) -> Episode:
    """One request, one fitting function among 0-4 others: the call, with the
    request's values typed as the function's parameters."""
    pool = _functions(arg_ok, False)
    target = r.choice(_functions(arg_ok, True) if eval_set else pool)
    offered = [_named(f, r) for f in [target, *_others(r, pool, target, r.choice([0, 1, 2, 3, 4]))]]
    named = offered[0]
    r.shuffle(offered)
    text, args = _draw(target, r)
    msgs = _messages_start(r) if r.random() < 0.6 else []
    msgs += [_user(r, text), {"role": "assistant", "content": None, "tool_calls": [_call(named.name, args, r)]}]
    return Episode(msgs, [f.schema() for f in offered], "function", "heldout" if eval_set else "train", 0)


def function_parallel_episode(r: random.Random, arg_ok, heldout: frozenset[str], eval_set: bool = False) -> Episode:
    """Two requests in one message (the same function or two): both calls in one reply, in order."""
    pool = _functions(arg_ok, False)
    first = r.choice(_functions(arg_ok, True) if eval_set else pool)
    second = first if r.random() < 0.5 else r.choice(pool)
    fns = {first.name: first, second.name: second}
    extra = [f for f in _others(r, pool, first, r.choice([0, 1, 2])) if f.name not in fns]
    offered = [_named(f, r) for f in [*fns.values(), *extra]]
    names = {f.name: o.name for f, o in zip(fns.values(), offered)}
    r.shuffle(offered)
    (t1, a1), (t2, a2) = _draw(first, r), _draw(second, r)
    joiner = r.choice([" Also, ", " And ", " Then: ", " Plus, "])
    text = t1 + joiner + t2[0].lower() + t2[1:]
    msgs = (_messages_start(r) if r.random() < 0.6 else []) + [_user(r, text)]
    msgs.append({"role": "assistant", "content": None,
                 "tool_calls": [_call(names[first.name], a1, r), _call(names[second.name], a2, r)]})
    return Episode(msgs, [f.schema() for f in offered], "function_parallel", "heldout" if eval_set else "train", 0)


DECLINES = ("None of the available functions can help with that: they {can}.",
            "I can't do that with the tools I have. They {can}, nothing else.",
            "Sorry, no function here fits that request; the ones I have {can}.")


def function_unfit_episode(r: random.Random, arg_ok, heldout: frozenset[str], eval_set: bool = False) -> Episode:
    """A request that none of the 1-4 offered functions fits: declined in
    text, no call. Half the time one or two of them are of the request's own
    domain (the circumference wanted, an area offered), so that reading the
    function, not the topic, decides."""
    pool = _functions(arg_ok, False)
    wanted = r.choice(_functions(arg_ok, True) if eval_set else pool)
    near = [f for f in pool if f.domain == wanted.domain and f.name != wanted.name]
    far = [f for f in pool if f.domain != wanted.domain]
    offered = r.sample(near, min(len(near), r.randint(1, 2))) if near and r.random() < 0.5 else []
    offered += r.sample(far, min(len(far), r.randint(0 if offered else 1, 4 - len(offered))))
    r.shuffle(offered)
    text, _ = _draw(wanted, r)
    can = " and ".join(f.decline for f in offered[:3])
    msgs = (_messages_start(r) if r.random() < 0.6 else []) + [_user(r, text)]
    msgs.append({"role": "assistant", "content": r.choice(DECLINES).format(can=can)})
    return Episode(msgs, [_named(f, r).schema() for f in offered], "function_unfit",
                   "heldout" if eval_set else "train", 0)
