"""Country → steering region (STEER-4).

The 13 region codes are the ones DNS load balancers use (Cloudflare's set).
Every ISO 3166-1 alpha-2 code maps to exactly one region; a test checks the
table against the full ISO list. Where a country straddles two regions (the
United States and Canada span WNAM and ENAM) the table picks the region most
of its population lives in; an operator overrides it per server or user with
an explicit ``region:``.
"""

from __future__ import annotations

REGIONS: dict[str, str] = {
    "WNAM": "Western North America",
    "ENAM": "Eastern North America",
    "WEU": "Western Europe",
    "EEU": "Eastern Europe",
    "NSAM": "Northern South America",
    "SSAM": "Southern South America",
    "OC": "Oceania",
    "ME": "Middle East",
    "NAF": "Northern Africa",
    "SAF": "Southern Africa",
    "SAS": "Southern Asia",
    "SEAS": "Southeast Asia",
    "NEAS": "Northeast Asia",
}

_BY_REGION: dict[str, str] = {
    "WNAM": "MX GT BZ SV HN NI CR PA",
    "ENAM": (
        "US CA BM PM GL AG AI AW BB BL BQ BS CU CW DM DO GD GP HT JM KN KY LC"
        " MF MQ MS PR SX TC TT VC VG VI"
    ),
    "NSAM": "CO VE GY SR GF EC PE BR BO",
    "SSAM": "AR CL UY PY FK GS",
    "WEU": (
        "AD AT BE CH DE DK ES FI FO FR GB GG GI IE IM IS IT JE LI LU MC MT NL"
        " NO PT SE SM VA AX SJ"
    ),
    "EEU": "AL BA BG BY CY CZ EE GR HR HU LT LV MD ME MK PL RO RS RU SI SK UA",
    "ME": "AE AM AZ BH GE IL IQ IR JO KW LB OM PS QA SA SY TR YE",
    "NAF": (
        "DZ EG EH LY MA SD TN MR ML NE TD SN GM GN GW SL LR CI BF GH TG BJ NG"
        " CV ET ER DJ SO SS"
    ),
    "SAF": (
        "AO BI BW CD CF CG CM GA GQ KE KM LS MG MU MW MZ NA RE RW SC SH ST SZ"
        " TZ UG YT ZA ZM ZW TF BV"
    ),
    "SAS": "AF BD BT IN LK MV NP PK IO KZ KG TJ TM UZ",
    "SEAS": "BN ID KH LA MM MY PH SG TH TL VN CX CC",
    "NEAS": "CN HK JP KP KR MN MO TW",
    "OC": (
        "AS AU CK FJ FM GU KI MH MP NC NF NR NU NZ PF PG PN PW SB TK TO TV UM"
        " VU WF WS HM AQ"
    ),
}

COUNTRY_REGION: dict[str, str] = {
    country: region for region, countries in _BY_REGION.items() for country in countries.split()
}


def region_of(country: str) -> str:
    """The default region of an ISO 3166-1 alpha-2 country code (upper case)."""
    return COUNTRY_REGION[country]
