import Link from "next/link";

export default function NotFound() {
  return (
    <main className="key-prompt">
      <div className="card">
        <h1>Not found</h1>
        <p>
          There is nothing at this address. <Link href="/">Open the chat</Link>.
        </p>
      </div>
    </main>
  );
}
