"""Request-validation failures as every service's HTTP API answers them: 400, naming the field, or what is
wrong with the body as a whole (not sent as JSON, or not an object)."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import BaseModel, Field

from rlfleet.http_errors import install_error_handlers, is_json_media_type


class Spec(BaseModel):
    name: str
    steps: int = Field(ge=1)


@pytest.fixture(scope="module")
def client() -> TestClient:
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/runs")
    async def submit(spec: Spec) -> dict[str, str]:
        return {"name": spec.name}

    return TestClient(app)


def test_a_bad_field_is_named(client: TestClient) -> None:
    response = client.post("/runs", json={"name": "a", "steps": 0})
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert message.startswith("body.steps: "), message


@pytest.mark.parametrize(
    ("headers", "fragment"),
    [
        ({"content-type": "application/x-www-form-urlencoded"}, "Content-Type is 'application/x-www-form-urlencoded'"),
        ({}, "the request has no Content-Type"),
    ],
)
def test_a_json_body_not_sent_as_json_names_the_content_type(
    client: TestClient, headers: dict[str, str], fragment: str
) -> None:
    response = client.post("/runs", content='{"name": "a", "steps": 1}', headers=headers)
    assert response.status_code == 400
    message = response.json()["error"]["message"]
    assert fragment in message and "send it with Content-Type: application/json" in message


def test_a_json_body_under_a_json_type_with_parameters_is_read(client: TestClient) -> None:
    response = client.post(
        "/runs", content='{"name": "a", "steps": 1}', headers={"content-type": "application/json; charset=utf-8"}
    )
    assert response.status_code == 200, response.text


def test_json_media_types() -> None:
    assert is_json_media_type("application/json")
    assert is_json_media_type("Application/JSON; charset=utf-8")
    assert is_json_media_type("application/problem+json")
    assert not is_json_media_type("application/x-www-form-urlencoded")
    assert not is_json_media_type("")


@pytest.mark.parametrize(("body", "got"), [("[1]", "an array"), ('"a"', "a string"), ("null", "null")])
def test_a_json_body_that_is_not_an_object_says_what_it_is(client: TestClient, body: str, got: str) -> None:
    response = client.post("/runs", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"body: must be a JSON object, got {got}"


def test_a_method_the_path_does_not_take_is_a_405_in_the_api_error_format(client: TestClient) -> None:
    response = client.get("/runs")
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json() == {
        "error": {
            "kind": "method_not_allowed",
            "message": "GET /runs: method not allowed; this path takes POST",
            "code": 405,
        }
    }


def test_a_405_names_the_methods_of_every_route_of_the_path() -> None:
    """The framework named only the first route's: with GET and POST served by two routes, a PUT was told the path
    takes POST, as if a GET were wrong too."""
    app = FastAPI()
    install_error_handlers(app)

    @app.post("/runs")
    async def submit() -> dict[str, str]:
        return {}

    @app.get("/runs")
    async def listed() -> dict[str, str]:
        return {}

    response = TestClient(app).put("/runs")
    assert response.status_code == 405 and response.headers["allow"] == "GET, POST"
    assert response.json()["error"]["message"] == "PUT /runs: method not allowed; this path takes GET, POST"


def test_a_path_no_route_serves_is_a_404_in_the_api_error_format(client: TestClient) -> None:
    response = client.post("/nowhere", json={})
    assert response.status_code == 404
    assert response.json() == {"error": {"kind": "not_found", "message": "POST /nowhere: no such path", "code": 404}}
