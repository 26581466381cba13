//! `GET /v1/models` and `GET /v1/models/{id}`: the served models, each with its versions and
//! what a request gets by default.

use axum::extract::State;
use axum::Json;
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::{ApiError, AppState};
use crate::service::{Caller, ChatError, Target};
use crate::workers::{ModelKey, ServedModel};
use hearth_shared::versions::compare_versions;

/// The served models.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    /// `list`
    pub object: String,
    pub data: Vec<ModelCard>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelCard {
    /// The model's name: a request's `model` names it (its newest version), or `id@version`
    /// one version.
    pub id: String,
    /// `model`
    pub object: String,
    pub created: i64,
    pub owned_by: String,
    /// The context in tokens of the version `id` means.
    #[schema(required = true)]
    pub max_model_len: Option<u64>,
    /// The version `id` means (the newest ready one), for a model from a repository.
    #[schema(required = true)]
    pub version: Option<String>,
    /// For people: the repository manifest's display name, else the id.
    pub display_name: String,
    /// Of the version `id` means.
    pub state: ModelState,
    /// Workers serving that version now.
    pub workers: u32,
    /// Every version some worker has reported, newest first.
    pub versions: Vec<ModelVersion>,
    /// While a worker fetches the version's file from a URL: the bytes fetched so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetched_bytes: Option<u64>,
    /// And the file's size, once its server has said it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetch_total_bytes: Option<u64>,
}

/// One version of a model.
#[derive(Debug, Serialize, ToSchema)]
pub struct ModelVersion {
    /// Empty for a model its worker was given by path.
    pub version: String,
    pub display_name: String,
    #[schema(required = true)]
    pub max_model_len: Option<u64>,
    pub state: ModelState,
    /// Workers serving it now.
    pub workers: u32,
    /// Workers that reported it, ready or not.
    pub known_workers: u32,
    /// As the card's.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetched_bytes: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fetch_total_bytes: Option<u64>,
}

/// Every model a worker serves, one card per model with its versions. The default model (the
/// one a request that names none gets) comes first, then the others by name.
#[utoipa::path(get, path = "/v1/models", operation_id = "listModels", tag = "openai",
    responses((status = 200, description = "The served models, the default first", body = ModelList)))]
pub async fn models(State(s): State<AppState>, _caller: Caller) -> Json<ModelList> {
    let served = s.chat.models();
    let default = s.chat.lookup(None).ok().and_then(|t| t.model);
    let ids = default.iter().chain(&served).map(|m| m.key.id.as_str());
    let mut data: Vec<ModelCard> = Vec::new();
    for id in ids {
        if data.iter().any(|c| c.id == id) {
            continue;
        }
        if let Ok(t) = s.chat.lookup(Some(id)) {
            data.push(model_card(&t, &served));
        }
    }
    add_available(&mut data, s.chat.available());
    Json(ModelList {
        object: "list".into(),
        data,
    })
}

/// The versions workers' repositories hold that no worker has loaded (`name@version` each), as
/// `available` versions of their cards, and cards of their own for models no worker serves: a
/// request for one loads it on demand.
fn add_available(data: &mut Vec<ModelCard>, available: Vec<ModelKey>) {
    for ModelKey { id: name, version } in &available {
        let (name, version) = (name.as_str(), version.as_str());
        let i = match data.iter().position(|c| c.id == name) {
            Some(i) => i,
            None => {
                data.push(ModelCard {
                    id: name.to_string(),
                    object: "model".into(),
                    created: 0,
                    owned_by: "hearth".into(),
                    max_model_len: None,
                    version: Some(version.to_string()),
                    display_name: name.to_string(),
                    state: ModelState::Available,
                    workers: 0,
                    versions: Vec::new(),
                    fetched_bytes: None,
                    fetch_total_bytes: None,
                });
                data.len() - 1
            }
        };
        let card = &mut data[i];
        if card.versions.iter().any(|v| v.version == version) {
            continue;
        }
        card.versions.push(ModelVersion {
            version: version.to_string(),
            display_name: name.to_string(),
            max_model_len: None,
            state: ModelState::Available,
            workers: 0,
            known_workers: 0,
            fetched_bytes: None,
            fetch_total_bytes: None,
        });
        card.versions
            .sort_by(|a, b| compare_versions(&b.version, &a.version));
        // A card of repository versions only names the newest.
        if card.workers == 0 && card.state == ModelState::Available {
            card.version = card.versions.first().map(|v| v.version.clone());
        }
    }
}

/// Where a model version stands: `ready` while a worker serves it, `loading` while one loads
/// it and none has it ready, `available` when only a worker's repository holds it (a request
/// loads it), else `unavailable` (no worker that has it is up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum ModelState {
    /// A worker serves it.
    Ready,
    /// A worker loads it, and none has it ready.
    Loading,
    /// Only a worker's repository holds it: a request for it loads it.
    Available,
    /// No worker that has it is up.
    Unavailable,
}

impl ModelState {
    fn of(m: &ServedModel) -> Self {
        match (m.ready_workers, m.loading_workers) {
            (0, 0) => Self::Unavailable,
            (0, _) => Self::Loading,
            _ => Self::Ready,
        }
    }
}

/// The card of `target`'s model, the version it names first among `served`'s of that id.
fn model_card(target: &Target, served: &[ServedModel]) -> ModelCard {
    let m = target.model.as_ref();
    let id = target.name();
    let versions = served
        .iter()
        .filter(|v| v.key.id == id)
        .map(|v| ModelVersion {
            version: v.key.version.clone(),
            display_name: v.display_name.clone(),
            max_model_len: v.context_length.map(|n| n as u64),
            state: ModelState::of(v),
            workers: v.ready_workers as u32,
            known_workers: v.workers as u32,
            fetched_bytes: v.fetch.map(|f| f.0),
            fetch_total_bytes: v.fetch.map(|f| f.1).filter(|&t| t > 0),
        })
        .collect();
    ModelCard {
        display_name: m.map_or_else(|| id.clone(), |m| m.display_name.clone()),
        id,
        object: "model".into(),
        created: 0,
        owned_by: "hearth".into(),
        max_model_len: target.context_length().map(|n| n as u64),
        version: m.map(|m| m.key.version.clone()).filter(|v| !v.is_empty()),
        state: m.map_or(ModelState::Unavailable, ModelState::of),
        workers: m.map_or(0, |m| m.ready_workers as u32),
        versions,
        fetched_bytes: m.and_then(|m| m.fetch).map(|f| f.0),
        fetch_total_bytes: m.and_then(|m| m.fetch).map(|f| f.1).filter(|&t| t > 0),
    }
}

/// One model by its id (its newest version), or one version as `id@version`; else 404.
#[utoipa::path(get, path = "/v1/models/{id}", operation_id = "retrieveModel", tag = "openai",
    params(("id" = String, Path, description = "The model's id, as `/v1/models` lists it, or `id@version`")),
    responses(
        (status = 200, description = "The model", body = ModelCard),
        (status = 404, description = "No model has this id (`model_not_found`)", body = crate::api::ErrorBody),
    ))]
pub async fn model(
    State(s): State<AppState>,
    _caller: Caller,
    axum::extract::Path(id): axum::extract::Path<String>,
) -> Result<Json<ModelCard>, ApiError> {
    let target = s.chat.lookup(Some(&id))?;
    if target.model.is_none() {
        // No worker has reported a model yet: nothing can be named.
        return Err(ChatError::ModelNotFound {
            asked: id,
            served: "no model yet".into(),
        }
        .into());
    }
    Ok(Json(model_card(&target, &s.chat.models())))
}
