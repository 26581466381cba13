import { describe, expect, it } from "vitest";
import { ApiError } from "../lib/api";
import { refusalBanner, secondsLeft } from "../lib/banner";

const retry = () => {};

describe("refusalBanner", () => {
  it("429: waits Retry-After seconds, or 60 without one", () => {
    const b = refusalBanner(new ApiError(429, "slow down", 7), retry, 1_000);
    expect(b).toMatchObject({ kind: "rate", retryAt: 8_000, retry });
    expect(b!.message).toContain("rate limit");
    expect(refusalBanner(new ApiError(429, "slow down"), retry, 0)!.retryAt).toBe(60_000);
  });

  it("503 offers a retry; 409 does not", () => {
    expect(refusalBanner(new ApiError(503, "busy"), retry, 0)).toMatchObject({ kind: "capacity", retry });
    const conflict = refusalBanner(new ApiError(409, "running"), retry, 0)!;
    expect(conflict.kind).toBe("conflict");
    expect(conflict.retry).toBeUndefined();
  });

  it("401 shows nothing (the key prompt answers it)", () => {
    expect(refusalBanner(new ApiError(401, "no key"), retry, 0)).toBeNull();
  });

  it("anything else shows its message with a retry", () => {
    expect(refusalBanner(new ApiError(500, "boom"), retry, 0)).toEqual({ kind: "error", message: "boom", retry });
    expect(refusalBanner(new TypeError("Failed to fetch"), retry, 0)).toEqual({
      kind: "error",
      message: "Failed to fetch",
      retry,
    });
    expect(refusalBanner("odd", retry, 0)).toMatchObject({ message: "odd" });
  });
});

describe("secondsLeft", () => {
  it("rounds up and stops at zero", () => {
    const b = refusalBanner(new ApiError(429, "x", 3), retry, 0);
    expect(secondsLeft(b, 0)).toBe(3);
    expect(secondsLeft(b, 2_001)).toBe(1);
    expect(secondsLeft(b, 3_000)).toBe(0);
    expect(secondsLeft(b, 9_000)).toBe(0);
  });

  it("is zero for banners without a wait", () => {
    expect(secondsLeft(null, 0)).toBe(0);
    expect(secondsLeft({ kind: "error", message: "x" }, 0)).toBe(0);
  });
});
