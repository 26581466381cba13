//! `/v1/admin/…`: each worker's models, and loading and unloading models on the workers. Only
//! admin keys (`hearth keys create --admin`) may call these routes; another key gets 403. A
//! server without keys listens on loopback only, and there its local user may.

use crate::invalid::Invalid;
use std::time::Duration;

use axum::extract::State;
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::{ApiError, AppState, ErrorCode, ValidJson};
use crate::service::Caller;
use crate::workers::{AdminError, WorkerModel, WorkerModels};

/// Longest unload deadline a request may ask for.
const MAX_DEADLINE_MS: u32 = 600_000;

pub fn routes() -> Router<AppState> {
    Router::new()
        .route("/v1/admin/workers", get(workers))
        .route("/v1/admin/models/load", post(load))
        .route("/v1/admin/models/unload", post(unload))
}

fn admin_only(caller: &Caller) -> Result<(), ApiError> {
    if caller.role.is_admin() {
        return Ok(());
    }
    Err(ApiError::Forbidden(
        "this route needs an admin key (`hearth keys create --admin`)".into(),
    ))
}

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        match e {
            AdminError::UnknownWorker(_) | AdminError::NotFound(_) => ApiError::Unprocessable {
                kind: ErrorCode::NotFound,
                message: e.to_string(),
            },
            AdminError::NoRoom { detail, .. } => ApiError::Unprocessable {
                kind: ErrorCode::InsufficientMemory,
                message: detail,
            },
            AdminError::NoWorker => ApiError::Unavailable(e.to_string()),
            AdminError::Failed(m) => ApiError::Unavailable(m),
        }
    }
}

/// Every worker and the models it holds.
#[derive(Debug, Serialize, ToSchema)]
pub struct WorkerList {
    pub data: Vec<WorkerModels>,
}

/// Each worker, its memory and its models with their state, bytes and load.
#[utoipa::path(get, path = "/v1/admin/workers", operation_id = "listWorkers", tag = "admin",
    responses(
        (status = 200, description = "The workers and their models", body = WorkerList),
        (status = 403, description = "Not an admin key", body = super::ErrorBody),
    ))]
pub async fn workers(
    State(s): State<AppState>,
    caller: Caller,
) -> Result<Json<WorkerList>, ApiError> {
    admin_only(&caller)?;
    Ok(Json(WorkerList {
        data: s.chat.worker_models(),
    }))
}

/// A model to load.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LoadModel {
    /// A model of the workers' repository: `name` (its newest version) or `name@version`.
    pub model: String,
    /// The worker to load it on (`worker-<n>`); absent: the ready worker with the most free
    /// memory whose repository has it.
    #[serde(default)]
    pub worker: Option<String>,
}

/// A model loaded.
#[derive(Debug, Serialize, ToSchema)]
pub struct Loaded {
    pub worker: String,
    pub model: WorkerModel,
}

/// Loads a model on a worker, and answers once it is ready.
#[utoipa::path(post, path = "/v1/admin/models/load", operation_id = "loadModel", tag = "admin",
    request_body = LoadModel,
    responses(
        (status = 200, description = "Loaded (or already loaded)", body = Loaded),
        (status = 403, description = "Not an admin key", body = super::ErrorBody),
        (status = 422, description = "No worker's repository has it (`not_found`), or it fits on no worker (`insufficient_memory`, naming the bytes needed and free)", body = super::ErrorBody),
        (status = 503, description = "No worker is ready, or its load failed", body = super::ErrorBody),
    ))]
pub async fn load(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<LoadModel>,
) -> Result<Json<Loaded>, ApiError> {
    admin_only(&caller)?;
    let model = check_model(&req.model)?;
    let (worker, model) = s.chat.load_model(model, req.worker.as_deref()).await?;
    Ok(Json(Loaded { worker, model }))
}

/// A model to unload.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UnloadModel {
    /// `name@version`, or `name`.
    pub model: String,
    /// Only from this worker; absent: from every worker that holds it.
    #[serde(default)]
    pub worker: Option<String>,
    /// How long its running requests may go on (at most 600000); those still running then
    /// continue on another worker serving the model, or end as unavailable. Absent: the
    /// workers' drain timeout.
    #[serde(default)]
    #[schema(maximum = 600000)]
    pub deadline_ms: Option<u32>,
}

/// Where a model was unloaded.
#[derive(Debug, Serialize, ToSchema)]
pub struct Unloaded {
    pub workers: Vec<UnloadedFrom>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct UnloadedFrom {
    pub worker: String,
    /// Requests cut short at the deadline.
    pub ended: u32,
}

/// Unloads a model, and answers once its memory is free.
#[utoipa::path(post, path = "/v1/admin/models/unload", operation_id = "unloadModel", tag = "admin",
    request_body = UnloadModel,
    responses(
        (status = 200, description = "Unloaded", body = Unloaded),
        (status = 403, description = "Not an admin key", body = super::ErrorBody),
        (status = 422, description = "No worker holds it (`not_found`)", body = super::ErrorBody),
        (status = 503, description = "A worker could not be reached", body = super::ErrorBody),
    ))]
pub async fn unload(
    State(s): State<AppState>,
    caller: Caller,
    ValidJson(req): ValidJson<UnloadModel>,
) -> Result<Json<Unloaded>, ApiError> {
    admin_only(&caller)?;
    let model = check_model(&req.model)?;
    let deadline = match req.deadline_ms {
        Some(ms) if ms > MAX_DEADLINE_MS => {
            return Err(ApiError::Validation(Invalid::field(
                "deadline_ms",
                format!("at most {MAX_DEADLINE_MS}"),
            )))
        }
        Some(ms) => Some(Duration::from_millis(u64::from(ms))),
        None => None,
    };
    let done = s
        .chat
        .unload_model(model, req.worker.as_deref(), deadline)
        .await?;
    Ok(Json(Unloaded {
        workers: done
            .into_iter()
            .map(|(worker, ended)| UnloadedFrom { worker, ended })
            .collect(),
    }))
}

fn check_model(m: &str) -> Result<&str, ApiError> {
    let m = m.trim();
    if m.is_empty() || m.len() > 256 {
        return Err(ApiError::Validation(Invalid::field(
            "model",
            "must be 1 to 256 characters, `name` or `name@version`",
        )));
    }
    Ok(m)
}
