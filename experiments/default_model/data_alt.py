"""A second, independent generator of evaluation turns for the agent model:
other domains (travel, clinics, smart homes, libraries, weather), camelCase
tool and argument names, its own system prompts, request and answer wording.
No training data comes from here; it measures whether what the model learned
from experiments/default_model/data.py and experiments/default_model/tasks.py carries over to
requests written by someone else.

Turns: a call (values inline, in parentheses, as a key: value list, or
stated in an earlier message), or an answer after a lookup whose result
holds it.
"""
from __future__ import annotations

import json
import random

from agentkv.experiments.default_model.tasks import Episode

ALT_SEED = 424_242_424

# service -> (tools: name -> (description, the action in words, [(argument, kind)]), answerable fields)
SERVICES = {
    "travel": ({
        "lookupReservation": ("Returns the details of a hotel or flight reservation.", "look at my reservation",
                              [("confirmationCode", "code")]),
        "changeSeat": ("Moves a passenger to another seat on a flight.", "move me to seat",
                       [("bookingReference", "code"), ("seatNumber", "seat")]),
        "cancelBooking": ("Cancels a booking and starts the refund.", "cancel my booking",
                          [("bookingReference", "code")]),
        "searchFlights": ("Finds flights between two airports on a date.", "find flights",
                          [("origin", "airport"), ("destination", "airport"), ("departureDate", "date")]),
    }, {"status": "confirmed", "gate": "B12", "departureTime": "07:45"}),
    "clinic": ({
        "getAppointment": ("Shows one appointment of a patient.", "show the appointment",
                           [("appointmentNumber", "num")]),
        "rescheduleAppointment": ("Moves an appointment to a new date.", "push the appointment",
                                  [("appointmentNumber", "num"), ("newDate", "date")]),
        "requestPrescriptionRefill": ("Asks the doctor to renew a prescription.", "refill the prescription",
                                      [("prescriptionRx", "rx"), ("pharmacyName", "shop")]),
    }, {"doctor": "Dr. Amara Osei", "room": "214", "time": "14:30"}),
    "home": ({
        "setThermostat": ("Sets the target temperature of a thermostat.", "set the heating",
                          [("deviceSerial", "serial"), ("targetCelsius", "temp")]),
        "toggleLight": ("Turns a light on or off.", "switch the light",
                        [("lightName", "room"), ("turnOn", "bool")]),
        "readSensor": ("Reads the latest value of a sensor.", "read the sensor", [("sensorSerial", "serial")]),
    }, {"reading": "21.5", "battery": "87%", "lastSeen": "09:12"}),
    "library": ({
        "renewLoan": ("Extends the due date of a borrowed book.", "renew the loan", [("loanBarcode", "barcode")]),
        "placeHold": ("Reserves a book for pick-up.", "put a hold on", [("isbn", "isbn"), ("branchName", "shop")]),
        "findBook": ("Looks a book up by its ISBN.", "look up the book", [("isbn", "isbn")]),
    }, {"dueDate": "2025-08-30", "copiesAvailable": "3", "shelf": "QA76.9"}),
    "weather": ({
        "getForecast": ("Weather forecast for a city.", "get the forecast",
                        [("cityName", "city"), ("forecastDays", "days")]),
        "getAirQuality": ("Air quality index at a postal code.", "check the air quality", [("postalCode", "zip")]),
    }, {"forecast": "light rain", "high": "18C", "aqi": "42"}),
}
CITIES = ("Porto", "Kyoto", "Accra", "Boise", "Riga", "Cusco", "Da Nang", "Gdansk", "Hobart", "Quebec City")
SHOPS = ("Riverside", "Old Town", "Central", "Harbourview", "North End")
ROOMS = ("kitchen", "hallway", "porch", "office", "bedroom")


def _value(r: random.Random, kind: str):
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    if kind == "code":
        return "".join(r.choice(letters + "23456789") for _ in range(6))
    if kind == "seat":
        return f"{r.randint(1, 40)}{r.choice('ABCDEF')}"
    if kind == "airport":
        return "".join(r.choice(letters) for _ in range(3))
    if kind == "date":
        return f"2025-{r.randint(1, 12):02d}-{r.randint(1, 28):02d}"
    if kind == "num":
        return r.randint(100000, 999999)
    if kind == "rx":
        return f"RX{r.randint(1000000, 9999999)}"
    if kind == "shop":
        return f"{r.choice(SHOPS)} {r.choice(['Pharmacy', 'Branch', 'Library'])}"
    if kind == "serial":
        return f"{r.choice(['TH', 'SN', 'HX'])}{r.getrandbits(24):06X}"
    if kind == "temp":
        return r.randint(16, 26)
    if kind == "room":
        return r.choice(ROOMS)
    if kind == "bool":
        return r.random() < 0.5
    if kind == "barcode":
        return f"3{r.randint(10**12, 10**13 - 1)}"
    if kind == "isbn":
        return f"978-{r.randint(0, 9)}-{r.randint(100, 999)}-{r.randint(10000, 99999)}-{r.randint(0, 9)}"
    if kind == "city":
        return r.choice(CITIES)
    if kind == "days":
        return r.randint(1, 10)
    if kind == "zip":
        return f"{r.randint(10000, 99999)}"
    raise ValueError(kind)


def _schema(name: str, desc: str, params: list[tuple[str, str]]) -> dict:
    types = {"num": "integer", "temp": "integer", "days": "integer", "bool": "boolean"}
    return {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {p: {"type": types.get(k, "string")} for p, k in params},
        "required": [p for p, _ in params]}}}


SYSTEMS = (
    "You're a friendly {service} concierge. Use functions to act on the user's behalf.",
    "Assistant for {service} requests. Respond with a function call when an action is needed, "
    "otherwise respond normally.",
    "[{service} bot] keep answers short",
    "You help customers of our {service} service. Ask nothing back; act with the tools provided.",
)


def _words(v) -> str:
    return json.dumps(v) if isinstance(v, bool) else str(v)


def _request(r: random.Random, action: str, args: dict, style: str) -> str:
    vals = [_words(v) for v in args.values()]
    if style == "inline":
        body = f"{action} {' '.join(vals)}" if len(vals) == 1 else f"{action}: " + " / ".join(vals)
    elif style == "paren":
        body = f"{action} (" + "; ".join(f"{k} {_words(v)}" for k, v in args.items()) + ")"
    elif style == "fields":
        body = action + "\n" + "\n".join(f"{k}: {_words(v)}" for k, v in args.items())
    else:  # earlier: the values in a message of their own, first
        body = f"{action}, using the details I sent"
    return r.choice(["", "hey - ", "Good evening! ", "Right, "]) + body + r.choice(["", ".", " pls", " - thanks"])


def alt_episodes(n: int, seed: int = ALT_SEED, answer_share: float = 0.25) -> list[Episode]:
    r = random.Random(seed)
    out = []
    for k in range(n):
        service = r.choice(list(SERVICES))
        tools, facts = SERVICES[service]
        offered = [_schema(t, d, p) for t, (d, _, p) in tools.items()]
        r.shuffle(offered)
        msgs = [{"role": "system", "content": r.choice(SYSTEMS).format(service=service)}]
        name = r.choice(list(tools))
        _, action, params = tools[name]
        args = {p: _value(r, kind) for p, kind in params}
        if r.random() < answer_share:
            fact = r.choice(list(facts))
            value = facts[fact]
            msgs.append({"role": "user", "content": f"{action} ({', '.join(_words(v) for v in args.values())}) "
                                                    f"and tell me the {fact}"})
            call_id = f"fc_{r.getrandbits(40):010x}"
            msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": call_id, "type": "function",
                         "function": {"name": name, "arguments": json.dumps(args)}}]})
            msgs.append({"role": "tool", "tool_call_id": call_id,
                         "content": json.dumps({"ok": True, **{fact: value}, "ref": _value(r, "code")})})
            msgs.append({"role": "assistant", "content": f"Your {fact} is {value}."})
            out.append(Episode(msgs, offered, "answer", "none", 0, [value]))
            continue
        style = ("inline", "paren", "fields", "earlier")[k % 4]
        if style == "earlier":
            msgs.append({"role": "user", "content": "Details: " + ", ".join(f"{_words(v)}" for v in args.values())})
            msgs.append({"role": "assistant", "content": "Thanks - what would you like me to do?"})
        msgs.append({"role": "user", "content": _request(r, action, args, style)})
        msgs.append({"role": "assistant", "content": None, "tool_calls": [{"id": f"fc_{r.getrandbits(40):010x}",
                     "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]})
        out.append(Episode(msgs, offered, "call", style, 0))
    return out
