//! The OpenAPI document: the committed copy is the generated one, and it describes every route
//! with the answers every route can give (Anthropic's routes with Anthropic's error shape, and a
//! bad value as a 400 there).

use serde_json::Value;

#[test]
fn the_committed_document_is_the_one_the_server_generates() {
    let generated = hearth_orchestrator::api::openapi_json();
    let committed = include_str!("../openapi.json");
    assert!(
        generated.trim_end() == committed.trim_end(),
        "orchestrator/openapi.json is out of date: run `make openapi` (it also regenerates the \
         web UI's types)"
    );
}

#[test]
fn every_operation_documents_its_errors_with_the_error_schema() {
    let doc: Value = serde_json::from_str(hearth_orchestrator::api::openapi_json()).expect("json");
    assert_eq!(doc["openapi"], "3.1.0");
    let paths = doc["paths"].as_object().expect("paths");
    let mut operations = 0;
    for (path, item) in paths {
        for (method, op) in item.as_object().expect("path item") {
            operations += 1;
            let id = op["operationId"].as_str().unwrap_or_default();
            assert!(!id.is_empty(), "{method} {path} has no operationId");
            let responses = op["responses"].as_object().expect("responses");
            let anthropic = path.starts_with("/v1/messages");
            let errors = match anthropic {
                true => "#/components/schemas/AnthropicError",
                false => "#/components/schemas/ErrorBody",
            };
            for status in ["401", "429", "503"] {
                let schema = &responses[status]["content"]["application/json"]["schema"]["$ref"];
                assert_eq!(schema, errors, "{method} {path}: {status}");
            }
            if path.contains("{id}") {
                assert!(responses.contains_key("404"), "{method} {path}: 404");
            }
            if op.get("requestBody").is_some() {
                for status in ["400", "413", "415"] {
                    assert!(responses.contains_key(status), "{method} {path}: {status}");
                }
                assert_eq!(
                    responses.contains_key("422"),
                    !anthropic,
                    "{method} {path}: 422"
                );
            }
        }
    }
    assert_eq!(operations, 28, "{:?}", paths.keys().collect::<Vec<_>>());
    let links = &paths["/v1/sessions"]["post"]["responses"]["201"]["links"];
    assert_eq!(
        links["postMessage"]["parameters"]["id"],
        "$response.body#/id"
    );
    assert_eq!(links["postMessage"]["operationId"], "postMessage");
}
