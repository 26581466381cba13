//! Ids in request paths, validated as they are extracted: a handler that takes a [`SessionId`]
//! or a [`MessageId`] holds a well-formed one. Anything else names nothing, so it is a 404 like
//! an unknown or another user's id, and never reaches the database.

use std::collections::HashMap;

use axum::extract::{FromRequestParts, Path};
use axum::http::request::Parts;

use super::openai::responses::kept::ResponseId;
use super::ApiError;
use crate::ids::{MessageId, SessionId};

macro_rules! path_id {
    ($name:ty, $param:literal, $what:literal) => {
        /// The route's `{
        #[doc = $param]
        /// }` segment.
        impl<S: Send + Sync> FromRequestParts<S> for $name {
            type Rejection = ApiError;

            async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
                let Path(params) =
                    Path::<HashMap<String, String>>::from_request_parts(parts, state)
                        .await
                        .map_err(|_| ApiError::NotFound($what))?;
                params
                    .get($param)
                    .and_then(|id| Self::parse(id))
                    .ok_or(ApiError::NotFound($what))
            }
        }
    };
}

path_id!(SessionId, "id", "session");
path_id!(MessageId, "message_id", "message");
path_id!(ResponseId, "id", "response");
